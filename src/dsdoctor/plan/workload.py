"""What one rank generates: batch, prompt length, new tokens, weight dtype."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from dsdoctor.dtypes import DTYPE_BYTES, normalize_dtype
from dsdoctor.errors import InputError

# far beyond any real run; past them the arithmetic describes nothing
MAX_BATCH = 1 << 20
MAX_TOKENS = 1 << 24


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
    for name, value, low, high in (("batch", batch, 1, MAX_BATCH), ("prompt length", prompt_len, 1, MAX_TOKENS),
                                   ("new tokens", new_tokens, 1, MAX_TOKENS)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, not {value!r}")
        if value > high:
            raise InputError(f"{name} is {value}; more than any inference run (limit {high})")
    name = dtype or model_dtype or "bf16"
    norm = normalize_dtype(name)
    if norm is None:
        raise InputError(f"unsupported dtype {name!r}", hint="use bf16, fp16 or fp32")
    if max_positions and prompt_len + new_tokens > max_positions:
        raise InputError(f"prompt length + new tokens = {prompt_len + new_tokens} exceeds the model's "
                         f"max_position_embeddings {max_positions}")
    return Workload(batch, prompt_len, new_tokens, norm)
