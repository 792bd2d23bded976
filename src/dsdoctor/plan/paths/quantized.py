"""Quantized weights: bitsandbytes int8 and nf4 (one replica per GPU), and DeepSpeed ZeRO-Inference int4
weight quantization under ZeRO-3. Modelled from the libraries' sources; not yet measured on a GPU, so
every path here is marked an estimate.

bitsandbytes through transformers (``BitsAndBytesConfig``): the ``nn.Linear`` layers inside the model are
replaced, the lm_head and the embeddings stay in the compute dtype.

* int8 (LLM.int8, ``Linear8bitLt``): 1 byte per weight plus one float32 scale per output row (``SCB``).
  Each matmul quantizes its input to int8 and accumulates in int32: the int32 output of the widest linear
  for all prefill tokens, plus the int8 input, is the workspace.
* nf4 (``Linear4bit``): 4 bits per weight plus one float32 absmax per block of 64 (``blocksize=64``;
  with double quantization 8 bits per block plus a float32 per 256 blocks). Beyond one token per sequence
  the weight is dequantized to the compute dtype for the matmul: the widest linear's full size is the
  workspace.
* DeepSpeed ``weight_quantization.quantized_initialization`` (``num_bits: 4, group_size: 64``): every
  linear weight stored as int4 with a float scale and minimum per group, partitioned by ZeRO-3; a gathered
  module is dequantized to the compute dtype for its forward, so the working set is ZeRO-3's, while the
  shards (and with offload the host copies and host-to-device traffic) shrink by about 3.2x.

Speed factors are assumptions stated here, not measurements: LLM.int8 decode runs at about a third of the
bf16 speed; nf4 at about 0.7 of it (dequantization per matmul; fewer bytes to read).
"""
from __future__ import annotations

import dataclasses

from dsdoctor.plan.loading import plain_methods, zero3_methods
from dsdoctor.plan.paths.base import TORCH_DTYPE, EstimatePath, assumption_moved, replayed
from dsdoctor.plan.paths.plain import plain_layout
from dsdoctor.plan.paths.zero3 import Zero3, Zero3Offload, zero3_code, zero3_config
from dsdoctor.plan.speed import StepTerms, estimate_speed

INT8_BYTES = 1.0
INT8_ROW_SCALE = 4  # bytes per output row
NF4_BYTES = 0.5 + 4 / 64  # 4-bit codes + float32 absmax per 64
NF4_DOUBLE_QUANT_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
INT4_GROUP_BYTES = 0.5 + 2 * 4 / 64  # int4 codes + float32 scale and minimum per group of 64
INT8_SPEED = 0.35
NF4_SPEED = 0.7


def _quantized_linears(inv):
    """Linear weights bitsandbytes replaces: 2-D linear weights inside the decoder layers (not the lm_head,
    not the embeddings)."""
    return [p for p in inv.params if p.kind == "linear" and len(p.shape) == 2 and p.layer is not None
            and p.name.endswith("weight")]


def bnb_estimate(name: str, plain, shape, wl):
    """``plain``'s estimate of the same workload with the decoder's linears quantized."""
    inv = shape.inventory
    b = wl.dtype_bytes
    linears = _quantized_linears(inv)
    lin_numel = sum(p.numel for p in linears)
    if name == "bnb-int8":
        q_bytes = int(lin_numel * INT8_BYTES + sum(p.shape[0] for p in linears) * INT8_ROW_SCALE)
        widest_out = max((p.shape[0] for p in linears), default=0)
        widest_in = max((p.shape[1] for p in linears), default=0)
        tokens = wl.batch * wl.prompt_len
        workspace = tokens * widest_out * 4 + tokens * widest_in
    else:
        q_bytes = int(lin_numel * NF4_BYTES)
        workspace = max((p.numel for p in linears), default=0) * b
    saved = lin_numel * b - q_bytes
    mem = dataclasses.replace(plain, name=name, notes=list(plain.notes))
    bd = dict(plain.gpu_breakdown)
    bd["weights_resident"] = bd.get("weights_resident", 0) - saved
    bd["dequant_workspace"] = int(workspace)
    mem.gpu_breakdown = {k: int(v) for k, v in bd.items() if v}
    mem.gpu_peak_bytes = int(sum(mem.gpu_breakdown.values()))
    mem.gpu_reserved_bytes = int(plain.gpu_reserved_bytes - saved + workspace)
    mem.resident_weight_bytes = int(plain.resident_weight_bytes - saved)
    mem.notes.append("bitsandbytes quantizes the decoder's linear layers; lm_head and embeddings stay "
                     f"{wl.dtype}")
    return mem


def bnb_speed(speed, name: str):
    f = INT8_SPEED if name == "bnb-int8" else NF4_SPEED
    return dataclasses.replace(speed, decode_step_s=speed.decode_step_s / f, prefill_s=speed.prefill_s / f,
                               tokens_per_s=speed.tokens_per_s * f, decode_tokens_per_s=speed.decode_tokens_per_s * f,
                               bound="dequantization")


def zero_int4_estimate(name: str, mem, shape, wl):
    """A ZeRO-3 estimate (``mem``) of the same workload with int4 weights."""
    inv = shape.inventory
    b = wl.dtype_bytes
    q = INT4_GROUP_BYTES / b  # stored bytes per compute-dtype byte
    lin = sum(p.numel for p in inv.params if p.kind in ("linear", "lm_head") and len(p.shape) == 2)
    share = lin / max(inv.num_params, 1)  # the part of the weights that is quantized
    shrink = 1 - share * (1 - q)
    mem = dataclasses.replace(mem, name=name, notes=list(mem.notes))
    bd = dict(mem.gpu_breakdown)
    if "weights_resident" in bd:
        cut = int(bd["weights_resident"] * (1 - shrink))
        bd["weights_resident"] -= cut
        mem.gpu_peak_bytes -= cut
        mem.gpu_reserved_bytes -= cut
    mem.gpu_breakdown = bd
    host = dict(mem.host_breakdown)
    for key in ("offloaded_params_pinned", "offloaded_params"):
        if key in host:
            host[key] = int(host[key] * shrink)
    mem.host_breakdown = host
    mem.host_peak_bytes = int(sum(host.values()))
    mem.gathered_bytes_per_step = int(mem.gathered_bytes_per_step * shrink)
    mem.notes.append("ZeRO-Inference int4 weights (quantized_initialization, group 64): shards and transfers "
                     "shrink, gathered modules are dequantized")
    return mem


def ds_weight_quantization() -> dict:
    return {"quantized_initialization": {"num_bits": 4, "group_size": 64, "group_dim": 1, "symmetric": False}}


def zero_int4_code(offload: str | None, model: str, gpus: int, dtype: str, knobs) -> tuple[dict, str]:
    """The ZeRO-3 config with ``weight_quantization``, and the code that uses it."""
    cfg = dict(zero3_config(offload, knobs, dtype), weight_quantization=ds_weight_quantization())
    return cfg, zero3_code(model, gpus, dtype, cfg)


def bnb_code(name: str, model: str, dtype_name: str, gpus: int) -> str:
    cfg = ("BitsAndBytesConfig(load_in_8bit=True)" if name == "bnb-int8" else
           f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_compute_dtype={dtype_name})")
    launch = (f"# one process per GPU, each with its own batch:\n#   torchrun --nproc_per_node {gpus} run.py\n"
              if gpus > 1 else "")
    return (f"{launch}import os, torch\nfrom transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
            f"device = f\"cuda:{{int(os.environ.get('LOCAL_RANK', 0))}}\"\n"
            f"model = AutoModelForCausalLM.from_pretrained({model!r}, dtype={dtype_name}, device_map=device,\n"
            f"                                             quantization_config={cfg})\n"
            "out = model.generate(**inputs, max_new_tokens=N)\n")


class Bnb(EstimatePath):
    """bitsandbytes weights, one replica per GPU; no config setting applies."""
    quantized = True

    def memory(self, ctx, wl, ratio=None):
        plain = replayed(plain_layout(ctx.hw.gpus), ctx, wl)
        return bnb_estimate(self.name, plain, ctx.shape, wl)

    def loading_methods(self, ctx, mem):
        return plain_methods(ctx.ckpt, ctx.wl.dtype, ctx.hw.gpus, ctx.weights)

    def speed(self, ctx, mem):
        return bnb_speed(estimate_speed(ctx.shape, ctx.wl, ctx.figures), self.name)

    def code(self, ctx, row):
        return bnb_code(self.name, ctx.model, TORCH_DTYPE[ctx.run_dtype], ctx.hw.gpus)


class BnbInt8(Bnb):
    name = "bnb-int8"


class BnbNf4(Bnb):
    name = "bnb-nf4"


class Zero3Int4(EstimatePath):
    """ZeRO-Inference int4 weights on a ZeRO-3 path the config does not select: its stage-3 tuning applies.
    Its speed is ZeRO-3's with the offload hook figure and no host-to-device or NVMe stream, as planned
    before the registry (the speed model keyed on the name ``zero3``)."""
    name = "zero3-int4"
    quantized = True
    base = Zero3

    def memory(self, ctx, wl, ratio=None):
        knobs = ctx.stage3_only()
        base = replayed(self.base().layout(ctx.hw.gpus, knobs), ctx, wl, knobs)
        return assumption_moved(zero_int4_estimate(self.name, base, ctx.shape, wl))

    def loading_methods(self, ctx, mem):
        return zero3_methods(ctx.ckpt, ctx.wl.dtype, mem.ranks, ctx.weights)

    def speed(self, ctx, mem):
        terms = StepTerms(hooks="zero3_offload_module_s", ranks=mem.ranks, moved=mem.gathered_bytes_per_step)
        return estimate_speed(ctx.shape, ctx.wl, ctx.figures, terms)

    def ds_config(self, ctx):
        return zero_int4_code(self.base.offload, ctx.model, ctx.hw.gpus, ctx.run_dtype, ctx.stage3_only())[0]

    def code(self, ctx, row):
        return zero_int4_code(self.base.offload, ctx.model, ctx.hw.gpus, ctx.run_dtype, ctx.stage3_only())[1]


class Zero3OffloadInt4(Zero3Int4):
    name = "zero3-offload-int4"
    base = Zero3Offload
