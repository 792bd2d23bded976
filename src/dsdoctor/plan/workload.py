"""What one rank generates: batch, prompt length, new tokens, weight dtype."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from dsdoctor.dtypes import DTYPE_BYTES, normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.units import MAX_BATCH, MAX_TOKENS, number


@dataclass(frozen=True)
class Workload:
    batch: int  # sequences each rank generates at once
    prompt_len: int
    new_tokens: int
    dtype: str  # bf16, fp16, fp32

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def final_len(self) -> int:
        """Positions in the KV cache after generate: the last new token is never fed back."""
        return self.prompt_len + max(self.new_tokens - 1, 0)

    def to_dict(self) -> dict:
        return asdict(self)


def make_workload(batch: int, prompt_len: int, new_tokens: int, dtype: str | None, model_dtype: str | None,
                  max_positions: int | None = None) -> Workload:
    batch = number(batch, "batch", low=1, high=MAX_BATCH)
    prompt_len = number(prompt_len, "prompt length", low=1, high=MAX_TOKENS)
    new_tokens = number(new_tokens, "new tokens", low=1, high=MAX_TOKENS)
    name = dtype or model_dtype or "bf16"
    norm = normalize_dtype(name)
    if norm is None:
        raise InputError(f"unsupported dtype {name!r}", hint="use bf16, fp16 or fp32")
    if max_positions and prompt_len + new_tokens > max_positions:
        raise InputError(f"prompt length + new tokens = {prompt_len + new_tokens} exceeds the model's "
                         f"max_position_embeddings {max_positions}")
    return Workload(batch, prompt_len, new_tokens, norm)
