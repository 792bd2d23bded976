"""ZeRO shards -> ordinary weights -> verification.

layout.py finds the files, unpickle.py reads them without running code, zero3.py / zero12.py turn them into
a plan (every output tensor as byte ranges of the shard files), writer.py streams the plan into safetensors,
merge.py and verify.py are the two library calls behind ``dsdoctor merge`` and ``dsdoctor verify``.
"""
