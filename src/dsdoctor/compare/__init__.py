"""``dsdoctor compare``: run the whole model through several load paths and show where outputs diverge.

Data flow: prompts (``prompts.py``) -> one ``PathRun`` per load path, recorded by the worker
(``runner.py``) in-process or in launched ranks (``launch.py``) -> per-prompt ``PromptDiff`` against the
reference (``diff.py``) -> ``CompareResult`` with findings (``api.py``, ``rules.json``).
"""
