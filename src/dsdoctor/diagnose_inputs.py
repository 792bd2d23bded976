"""What diagnose plans and checks with, and where each came from: the flags, else what the user's run handed over
(its config, model and workload, ``Captured``), ab's variant that ran, the command's own flags, the defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from dsdoctor import door
from dsdoctor.diagnose_step import SKIPPED, Step
from dsdoctor.dtypes import TORCH_NAMES, normalize_dtype
from dsdoctor.errors import InputError
from dsdoctor.i18n import fill
from dsdoctor.report.render import to_json


def bundled_example() -> tuple[Path, Path]:
    """The bundled training ZeRO-3 offload config and 7B Llama-shaped config.json."""
    root = Path(str(resources.files("dsdoctor") / "examples"))
    return root / "train_zero3_offload.json", root / "llama-7b"
DEFAULT_WORKLOAD = {"batch": 1, "prompt_len": 512, "new_tokens": 128}
ZERO_CONFIG_APIS = ("deepspeed.initialize", "HfDeepSpeedConfig")


@dataclass
class Captured:
    """What a traced run handed over: its DeepSpeed config, its model, its generate workload (each may be None)."""
    config: dict | None = None
    config_api: str | None = None
    config_source: str | None = None
    model_dir: Path | None = None  # a directory holding the captured config.json, for plan and check
    model_class: str | None = None
    num_params: int | None = None
    dtype: str | None = None
    workload: dict | None = None
    world_size: int | None = None
    init_inference: dict | None = None  # the summary of an init_inference call (tp_size, ...)
    init_inference_config: dict | None = None  # the config init_inference received (with its keyword arguments)
    offload_param: str | None = None  # what DeepSpeed ran: cpu, nvme or None
    stage: int | None = None  # the ZeRO stage DeepSpeed ran (None: no DeepSpeed engine was built)
    encoder_decoder: bool = False
    unreadable: str | None = None  # why the captured config could not be read, when it could not
    model_from: str = "from the run"  # or "from ab's variant NAME": the trace that recorded model and workload
    variant_workload: dict | None = None  # the workload of ab's variant that ran, when the run never generated
    variant: str | None = None
    flags: dict = field(default_factory=dict)  # what the command's own flags say (``command_flags``)

    @classmethod
    def from_trace(cls, traced, tmp: Path) -> Captured:
        ranks = sorted(traced.ranks, key=lambda r: r.rank)
        c = cls()
        for r in ranks:
            c._take_config(r)
            if c.model_dir is None and r.model_captured and isinstance(r.model_captured.get("config"), dict):
                c._take_model(r.model_captured, tmp)
            if c.workload is None and r.workload:
                c.workload = r.workload
            c.world_size = c.world_size or r.world_size
            if c.stage is None:
                c.stage = _run_stage(r)
        if c.stage is None and ranks:
            c.stage = 0  # the run built no DeepSpeed engine and passed no stage: nothing is partitioned
            if c.dtype is None or r.dtype:
                c.dtype = r.dtype or c.dtype
        if c.config is not None:
            door.write_new(tmp / "ds_config_captured.json", to_json(c.config))
        return c

    def _take_config(self, r) -> None:
        """The first config a rank handed to DeepSpeed (initialize or HfDeepSpeedConfig; init_inference apart)."""
        passed = r.config_passed or {}
        if self.config is None and passed.get("api") in ZERO_CONFIG_APIS and isinstance(r.config_captured, dict):
            self.config, self.config_api, self.config_source = r.config_captured, passed["api"], passed.get("source")
        if self.init_inference is None and passed.get("api") == "deepspeed.init_inference":
            self.init_inference = dict(passed)
            self.init_inference_config = r.config_captured if isinstance(r.config_captured, dict) else None
        self.offload_param = self.offload_param or r.offload_param or passed.get("offload_param")

    def _take_model(self, m: dict, tmp: Path) -> None:
        """The model a rank built, its config.json written to ``tmp/model`` for plan and check."""
        directory = door.make_dir(tmp / "model")
        saved = dict(m["config"])
        if not saved.get("architectures") and m.get("model_class"):
            saved["architectures"] = [m["model_class"]]
        if not (saved.get("torch_dtype") or saved.get("dtype")) and m.get("param_dtype"):
            saved["torch_dtype"] = m["param_dtype"]  # the dtype the run's weights really had
        door.write_new(directory / "config.json", to_json(saved))
        self.model_dir, self.model_class, self.num_params = directory, m.get("model_class"), m.get("num_params")
        self.encoder_decoder = bool(m.get("is_encoder_decoder"))
        self.dtype = normalize_dtype(str(m.get("param_dtype")))

    def add_variant(self, ab_result, tmp: Path) -> None:
        """What the run never reached, from the variant of ab that ran (the fix ab names first): the model it
        built (its config.json), its dtype and the workload it generated with."""
        ran = [v for v in (ab_result.variants if ab_result is not None else []) if v.status == "ok" and v.shape]
        fix = ab_result.diagnosis if ab_result is not None else None
        named = str(fix.values.get("variant")) if fix is not None and fix.code == "DSD316" else None
        v = next((v for v in ran if v.name == named), ran[0] if ran else None)
        if v is None:
            return
        self.variant, shape = v.name, v.shape
        self.variant_workload = {k: shape.get(k) for k in ("batch", "prompt_len", "new_tokens")}
        if self.model_dir is None and isinstance(shape.get("model_config"), dict):
            self._take_variant_model(v.name, shape, tmp)
        self.world_size = self.world_size or shape.get("world_size")

    def _take_variant_model(self, name: str, shape: dict, tmp: Path) -> None:
        saved = dict(shape["model_config"])
        short = normalize_dtype(str(shape.get("dtype")))
        if not (saved.get("torch_dtype") or saved.get("dtype")) and short in TORCH_NAMES:
            saved["torch_dtype"] = TORCH_NAMES[short]  # transformers reads torch's name, not bf16/fp32
        directory = door.make_dir(tmp / "model")
        door.write_new(directory / "config.json", to_json(saved))
        self.model_dir, self.model_from = directory, f"from ab's variant {name}"
        self.model_class = (saved.get("architectures") or [None])[0]
        self.dtype = self.dtype or short

    def workloads(self) -> list[tuple]:
        """The workloads the run says, in order: (dict, where it came from)."""
        return [(self.workload, "the run"), (self.variant_workload, f"ab's variant {self.variant}"),
                (self.flags, "the command line")]

    def config_file(self) -> str | None:
        """The file the run read its config from, when it still says what the run passed (checks then name it)."""
        src = self.config_source
        if not src or src == "dict" or not Path(src).is_file():
            return None
        try:
            from dsdoctor.config.load import load_config

            return src if load_config(src).raw == self.config else None
        except Exception:
            return None

    def config_text(self) -> str:
        src = self.config_source if self.config_source not in (None, "dict") else "a dict built in the script"
        return f"captured from {self.config_api}: {src}"

    def model_text(self) -> str:
        n = f"{self.num_params / 1e6:.2f}M parameters" if self.num_params else "parameters unknown"
        return f"captured {self.model_from}: {self.model_class or 'model'}, {n}"
def _run_stage(r) -> int | None:
    """The ZeRO stage a rank ran, else the one it passed, else None."""
    configured = (r.config_passed or {}).get("stage")
    return r.zero_stage if r.zero_stage is not None else configured if isinstance(configured, int) else None


FLAGS = {  # what a command's own flags say, as inference scripts spell them
    "model": ("--model", "--model_name_or_path", "--model-name-or-path", "--model_path", "--model-path"),
    "batch": ("--batch", "--batch-size", "--batch_size"), "dtype": ("--dtype", "--torch-dtype", "--torch_dtype"),
    "prompt_len": ("--prompt-len", "--prompt_len", "--input-len", "--input_len"),
    "new_tokens": ("--new-tokens", "--new_tokens", "--max-new-tokens", "--max_new_tokens"),
}


def command_flags(command: list[str]) -> dict:
    """{"model", "batch", "prompt_len", "new_tokens", "dtype"} as the command's flags give them (``--batch 4`` or
    ``--batch=4``); numbers as ints, the model's flag kept to say where it came from."""
    out: dict = {}
    args = [str(a) for a in command]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        key = next((k for k, names in FLAGS.items() if flag in names), None)
        if key is None or not value or key in out:
            continue
        if key in ("model", "dtype"):
            out[key] = value
            if key == "model":
                out["model flag"] = flag
        elif value.isdigit() and int(value) > 0:
            out[key] = int(value)
    return out


def _handed_zero(cfg: dict | None) -> bool:
    """An init_inference config that carries a ZeRO section (``zero``, or a ZeRO config as ``args``)."""
    if not isinstance(cfg, dict):
        return False
    from dsdoctor.config.inference_config import read_inference_config

    try:
        return bool(read_inference_config(cfg).zero)
    except Exception:  # a config beyond reading is reported as the run's, not checked here
        return False


def _unreadable_model(directory: Path) -> str | None:
    """None when dsdoctor can read the captured config.json as a model spec, else the problem."""
    from dsdoctor.model.spec import load_model_spec

    try:
        load_model_spec(directory)
    except InputError as exc:
        return exc.problem
    return None


def _workload_value(given, found: list[tuple], key: str) -> tuple[int, str]:
    """A workload number and where it came from: the flag, what the run says (``found``: (dict, where) in order:
    the traced generate, ab's variant that ran, the command's flags), or the default."""
    if given is not None:
        return given, "given"
    for values, where in found:
        value = (values or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value, where
    return DEFAULT_WORKLOAD[key], "default"


def _no_config_reason(captured: Captured | None) -> dict[str, str]:
    if captured is not None and captured.init_inference is not None:
        return fill(SKIPPED["init_inference"], tp=captured.init_inference.get("tp_size") or 1)
    if captured is not None and captured.unreadable:
        return fill(SKIPPED["unreadable config"], problem=captured.unreadable)
    if captured is not None:
        return SKIPPED["no config passed"]
    return SKIPPED["no config"]


def _load(config):
    from dsdoctor.config.load import load_config

    return load_config(config)


def _given_sources(command, config, model) -> tuple:
    """(config, model, sources) before anything runs: the bundled example when nothing is given; bad input ends."""
    if command is None and config is None and model is None:
        config, model = bundled_example()
        return config, model, {"config": "bundled example", "model": "bundled example"}
    if command is None and config is None:
        raise InputError("diagnose needs --config (the DeepSpeed config your inference uses), or your command "
                         "after -- to capture it from the run")
    if command is None and model is None:
        raise InputError("diagnose needs --model (a local model directory or its config.json), or your command "
                         "after -- to capture it from the run")
    return config, model, {}


@dataclass
class Inputs:
    """What the steps plan and check with, each with where it came from (``sources``)."""
    config: object
    loaded: object
    model: object
    gpus: int | None
    dtype: str | None
    workload: tuple
    sources: dict


@dataclass
class Run:
    """What running the user's command gave: its trace and what it handed over, and ab when it ran."""
    captured: Captured
    trace_step: Step
    traced: object
    ab_step: Step | None = None
    ab_result: object = None


def _captured_config(config, loaded, captured: Captured, sources: dict) -> tuple:
    """The config to check: the one given, else what the run handed to DeepSpeed."""
    if config is None and captured.config is None and _handed_zero(captured.init_inference_config):
        config = captured.init_inference_config  # a ZeRO section init_inference ignores: check and split it
        sources["config"] = "captured from deepspeed.init_inference: a zero section it ignores"
        return config, _load(config)
    if config is None and captured.config is not None:
        try:
            loaded = _load(captured.config_file() or captured.config)
            config, sources["config"] = captured.config_file() or captured.config, captured.config_text()
        except InputError as exc:  # the run's config is beyond reading: report the run without it
            captured.unreadable = exc.problem
    return config, loaded


def _captured_model(captured: Captured, sources: dict):
    """The model the run built (or the variant that ran, or the command line names), when plan can take it."""
    if captured.model_dir is not None:
        problem = _unreadable_model(captured.model_dir)
        if problem is None and captured.encoder_decoder:
            problem = "an encoder-decoder model; plan models decoder-only LLMs"
        if problem is None:
            sources["model"] = captured.model_text()
            return captured.model_dir
        sources["model"] = f"{captured.model_text()}; plan cannot take it: {problem}"
    named = captured.flags.get("model")
    if named is not None:
        problem = _unreadable_model(Path(named)) if Path(named).exists() else "not a local directory here"
        if problem is None:
            sources["model"] = f"from the command line: {captured.flags['model flag']} {named}"
            return named
        sources.setdefault("model", f"the command line names {named} ({problem}; pass --model DIR)")
    return None


def _inputs(config, loaded, model, gpus, dtype, given: tuple, run: Run | None, sources: dict) -> Inputs:
    """Every input of the steps, from the flags, else from the run (its trace, the variant of ab that ran, its
    command line), else the defaults; ``sources`` says which for each."""
    captured = run.captured if run is not None else None
    if captured is not None:
        config, loaded = _captured_config(config, loaded, captured, sources)
        if model is None:
            model = _captured_model(captured, sources)
    if config is None:
        sources["config"] = _no_config_reason(captured)["en"]
    sources.setdefault("config", "given")
    sources.setdefault("model", "given" if model is not None else "the run built no model dsdoctor could read")
    from_run = sources["model"] != "given"
    wl = _workload(*given, captured.workloads() if captured else None,
                   _max_positions(model) if from_run and model is not None else None)
    sources["workload"] = f"batch {wl[0]}, prompt {wl[1]} tokens, {wl[2]} new tokens ({wl[3]})"
    if gpus is None and captured is not None and captured.world_size and from_run:
        gpus = captured.world_size
    dtype, sources["dtype"] = _dtype(dtype, captured, from_run)
    return Inputs(config, loaded, model, gpus, dtype, wl, sources)


def _dtype(dtype, captured: Captured | None, from_run: bool) -> tuple:
    """The dtype and where it came from: the flag, the run's weights, the command's --dtype, else config.json."""
    flagged = normalize_dtype(captured.flags["dtype"]) if captured is not None and captured.flags.get("dtype") else None
    if dtype is not None:
        return dtype, "given"
    if captured is not None and from_run and captured.dtype:
        return captured.dtype, f"{captured.dtype}, {captured.model_from}"
    return flagged, (f"{flagged}, from the command line" if flagged else "the model's config.json")


def _max_positions(model) -> int | None:
    try:
        from dsdoctor.model.spec import load_model_spec

        value = load_model_spec(model).max_position_embeddings
    except Exception:
        return None
    return value if isinstance(value, int) and value > 1 else None


def _workload(batch, prompt_len, new_tokens, found: dict | list | None,
              max_positions: int | None = None) -> tuple[int, int, int, str]:
    """(batch, prompt, new tokens, where they came from). ``found``: what the run says, a dict (the traced
    generate) or (dict, where) pairs in order. Defaults that do not fit a captured model's context (a run that
    never called generate, with a small model) shrink to fit: 3/4 prompt, 1/4 new tokens."""
    found = [(found, "the run")] if isinstance(found, dict) else (found or [])
    b, bs = _workload_value(batch, found, "batch")
    p, ps = _workload_value(prompt_len, found, "prompt_len")
    n, ns = _workload_value(new_tokens, found, "new_tokens")
    if max_positions and p + n > max_positions:
        if ps == "default":
            p = max(1, min(p, (max_positions * 3) // 4 - (0 if ns == "default" else n)))
        if ns == "default":
            n = max(1, min(n, max_positions - p))
    kinds = {bs, ps, ns}
    if len(kinds) == 1:
        how = {"default": "defaults", "given": "given"}.get(bs, f"from {bs}")
    else:
        how = ", ".join(f"{k} {'from ' + v if v not in ('given', 'default') else v}"
                        for k, v in (("batch", bs), ("prompt", ps), ("new tokens", ns)))
    return b, p, n, how
