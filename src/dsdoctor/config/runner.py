"""What runs a config, and for what: the runner (raw ``deepspeed.initialize``, ``deepspeed.init_inference``, the
HF Trainer through LLaMA-Factory, axolotl, ms-swift or a TrainingArguments file, accelerate) and its mode
(train, eval, predict, predict-with-generate, inference).

The runner decides how "auto" is read (the HF Trainer and accelerate fill it; raw DeepSpeed does not) and which
findings apply: a ``do_train`` YAML gets training findings only, ``do_predict`` goes through the Trainer's
inference path (``deepspeed_init(inference=True)``: ZeRO-3 required, optimizer dropped). Torch-free.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dsdoctor.config.load import SWIFT_BUILTIN, LoadedConfig
from dsdoctor.config.schema import INIT_INFERENCE_ALL_KEYS, INIT_INFERENCE_KEYS

MODES = ("train", "eval", "predict", "predict-with-generate", "inference")
MODE_ALIASES = {"training": "train", "predict_with_generate": "predict-with-generate"}
INFERENCE_MODES = ("eval", "predict", "predict-with-generate", "inference")

LABELS = {
    "deepspeed": "deepspeed.initialize",
    "init_inference": "deepspeed.init_inference",
    "hf-trainer": "HF Trainer (TrainingArguments)",
    "llamafactory": "LLaMA-Factory (HF Trainer)",
    "axolotl": "axolotl (HF Trainer)",
    "ms-swift": "ms-swift (HF Trainer)",
    "accelerate": "accelerate",
}
HF_TRAINER_RUNNERS = ("hf-trainer", "llamafactory", "axolotl", "ms-swift")
_LF_STAGES = {"pt", "sft", "rm", "ppo", "dpo", "kto"}


@dataclass
class Runner:
    name: str  # a key of LABELS
    mode: str  # one of MODES
    mode_source: str  # why this mode: the flags that say it, "--mode", or "default"
    command: str | None = None  # program and sub-command of a command line (swift sft, llamafactory-cli train)
    model: str | None = None  # model_name_or_path / base_model / model, as the trainer args say
    predict_with_generate: bool = False

    @property
    def label(self) -> str:
        return LABELS[self.name]

    @property
    def fills_auto(self) -> bool:
        """The runner fills "auto" (HF Trainer / accelerate); raw deepspeed.initialize does not."""
        return self.name in HF_TRAINER_RUNNERS or self.name == "accelerate"

    @property
    def hf_trainer(self) -> bool:
        return self.name in HF_TRAINER_RUNNERS

    @property
    def inference(self) -> bool:
        return self.mode in INFERENCE_MODES

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "mode": self.mode, "mode_source": self.mode_source,
                "fills_auto": self.fills_auto, "command": self.command, "model": self.model}


def normalize_mode(mode: str | None) -> str | None:
    if mode is None:
        return None
    return MODE_ALIASES.get(mode, mode)


def is_init_inference_config(raw: dict) -> bool:
    """A dict for ``deepspeed.init_inference(config=...)``: only DeepSpeedInferenceConfig's keys, at least one
    that only it has (or its ``tensor_parallel.tp_size`` / ``zero`` spellings)."""
    keys = [k for k in raw if not k.startswith("_")]
    if not keys or any(k not in INIT_INFERENCE_ALL_KEYS for k in keys):
        return False
    tp = raw.get("tensor_parallel")
    return (any(k in INIT_INFERENCE_KEYS for k in keys) or "zero" in raw
            or (isinstance(tp, dict) and "tp_size" in tp and "autotp_size" not in tp))


def _true(value) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _which_trainer(src: dict, command: str, ref: str | None) -> str:
    prog = command.split(" ", 1)[0].rsplit("/", 1)[-1] if command else ""
    if prog == "swift" or (isinstance(src.get("deepspeed"), str) and src["deepspeed"] in SWIFT_BUILTIN) or any(
            k in src for k in ("train_type", "sft_type", "infer_backend", "ckpt_dir", "adapters")):
        return "ms-swift"
    if prog in ("llamafactory-cli", "lmf") or str(src.get("stage", "")).lower() in _LF_STAGES or any(
            k in src for k in ("finetuning_type", "template", "cutoff_len")):
        return "llamafactory"
    if prog == "axolotl" or "axolotl" in command or any(
            k in src for k in ("base_model", "micro_batch_size", "sequence_len", "datasets")):
        return "axolotl"
    return "hf-trainer"


def _trainer_mode(name: str, src: dict, command: str) -> tuple[str, str]:
    words = command.split()
    sub = words[1] if len(words) > 1 else ""
    if name == "ms-swift" and sub:
        return {"sft": "train", "pt": "train", "rlhf": "train", "infer": "inference", "eval": "eval",
                "deploy": "inference", "sample": "inference"}.get(sub, "train"), f"swift {sub}"
    if name == "llamafactory" and sub in ("chat", "api", "webchat", "webui"):
        return "inference", f"llamafactory-cli {sub}"
    if name == "axolotl" and ("inference" in command):
        return "inference", "axolotl inference"
    gen = _true(src.get("predict_with_generate"))
    if _true(src.get("do_train")):
        return "train", "do_train"
    if _true(src.get("do_predict")):
        return ("predict-with-generate", "do_predict + predict_with_generate") if gen else ("predict", "do_predict")
    if _true(src.get("do_eval")):
        return ("predict-with-generate", "do_eval + predict_with_generate") if gen else ("eval", "do_eval")
    if name == "ms-swift" and not any(k in src for k in ("dataset", "train_type")) and any(
            k in src for k in ("infer_backend", "ckpt_dir", "adapters")):
        return "inference", "infer_backend/ckpt_dir without a dataset"
    return "train", "default: a trainer's arguments without do_eval/do_predict"


_SIZE = re.compile(r"(?<![0-9A-Za-z.])(\d+(?:\.\d+)?)\s*[bB](?![A-Za-z0-9])")


def size_from_name(name: str | None) -> str | None:
    """"Meta-Llama-3-8B-Instruct" -> "8B" (what the name says; None when it says nothing)."""
    if not name:
        return None
    m = _SIZE.search(str(name).rsplit("/", 1)[-1].replace("_", "-"))
    return f"{m.group(1)}B" if m else None


def detect_runner(loaded: LoadedConfig, mode: str | None = None, runner: str | None = None) -> Runner:
    """The runner and mode of ``loaded``; ``mode`` (``--mode``) and ``runner`` (``--runner``, for a bare DeepSpeed
    JSON that a trainer runs) override what the file says."""
    if runner is not None and runner not in LABELS:
        from dsdoctor.errors import InputError

        raise InputError(f"runner must be one of {', '.join(LABELS)}, not {runner!r}")
    mode = normalize_mode(mode)
    if mode is not None and mode not in MODES:
        from dsdoctor.errors import InputError

        raise InputError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    src = loaded.source or {}
    if loaded.kind == "accelerate-yaml":
        r = Runner("accelerate", "inference", "default: an accelerate config does not say what the script does")
    elif loaded.kind == "command" and src.get("_raw_deepspeed"):  # a script reading --deepspeed_config itself
        m, why = _trainer_mode("deepspeed", src, "")
        if why.startswith("default"):
            m, why = "inference", "default"
        r = Runner("deepspeed", m, why, command=src.get("_command") or None)
    elif loaded.kind in ("trainer-yaml", "trainer-args", "command"):
        command = src.get("_command") or None
        name = _which_trainer(src, command or "", loaded.ref_path)
        m, why = _trainer_mode(name, src, command or "")
        model = src.get("model_name_or_path") or src.get("base_model") or src.get("model")
        r = Runner(name, m, why, command=command, model=str(model) if model else None,
                   predict_with_generate=_true(src.get("predict_with_generate")))
    elif is_init_inference_config(loaded.raw):
        r = Runner("init_inference", "inference", "init_inference keys")
    else:
        r = Runner("deepspeed", "inference", "default")
    if runner is not None and runner != r.name:
        r.name = runner
        if runner in HF_TRAINER_RUNNERS and mode is None:
            r.mode, r.mode_source = "train", "default for --runner " + runner
        elif mode is None:
            r.mode, r.mode_source = "inference", "default for --runner " + runner
    if mode is not None:
        r.mode, r.mode_source = mode, "--mode"
    return r
