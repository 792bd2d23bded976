"""Dtype names: any spelling (``torch.bfloat16``, ``half``, ``fp32``) to the short name dsdoctor uses
(bf16, fp16, fp32), the short name to torch's, and bytes per element. Torch-free."""
from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # short -> torch.<name>
_DTYPE_NAMES = {
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
}


def normalize_dtype(name: str | None) -> str | None:
    """The short name of ``name`` (``torch.bfloat16`` -> bf16), or None when it is not a float dtype we know."""
    if name is None:
        return None
    key = str(name).replace("torch.", "").lower()
    return _DTYPE_NAMES.get(key)
