"""Step 5 of ``dsdoctor diagnose``, the way out (the path step 2 recommends, its config and commands, or the fix
ab measured), and the summary the report leads with (its verdict and actions)."""
from __future__ import annotations

import copy
import shlex
from pathlib import Path

from dsdoctor import door
from dsdoctor.diagnose_inputs import Inputs
from dsdoctor.diagnose_step import SKIPPED, SUMMARY, Step, _shell, _skipped, _with_inputs
from dsdoctor.findings import Finding
from dsdoctor.i18n import LANGS, fill
from dsdoctor.report.render import to_json
from dsdoctor.report.summary import TEXT as SUMMARY_TEXT
from dsdoctor.report.summary import Action, Summary, before_after
from dsdoctor.report.summary import verdict as summary_verdict


def current_path(stage, offload_param, tp_size=None) -> str:
    """The plan path a config amounts to: ZeRO-3 (with its offload), tensor parallel, else plain."""
    if stage == 3:
        return {"cpu": "zero3-offload", "nvme": "zero3-offload-nvme"}.get(offload_param or "", "zero3")
    return "tp" if (tp_size or 1) > 1 else "plain"


def _compare_path(path: str) -> str | None:
    """compare's name for a plan path (compare runs plain, zero3, zero3-offload and tp)."""
    if path.startswith("tp"):
        return "tp"
    return path if path in ("plain", "zero3", "zero3-offload") else None


def _launches(code: str | None) -> list[str]:
    """The launch lines plan's emitted code names in its comments (``# deepspeed --num_gpus 1 run.py``)."""
    out = []
    for line in (code or "").splitlines():
        text = line.lstrip("#").strip().rstrip("&").strip()
        if line.startswith("#") and text.split(" ", 1)[0] in ("deepspeed", "torchrun", "python"):
            out.append(text.replace("run.py", "your_infer.py"))
    return out


def _path_config(path: str, split_config: dict | None, recommended: dict | None) -> dict:
    """The deepspeed.initialize config of a ZeRO-3 path: the split inference config where there is one (its
    knobs kept), with offload_param as the path needs it (offload only when the path offloads)."""
    cfg = copy.deepcopy(split_config) if split_config else copy.deepcopy(recommended or {})
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    want = ((recommended or {}).get("zero_optimization") or {}).get("offload_param")
    have = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else None
    if path == "zero3":
        zero.pop("offload_param", None)
    elif want and (have is None or have.get("device") != want.get("device")):
        zero["offload_param"] = copy.deepcopy(want)
    return cfg


def _keep_plain(plan_result, traced_stage: int) -> Step:
    """Step 5 when the traced run already loads the whole model on each rank: there is no ZeRO-3 to leave."""
    edge = " edge" if plan_result.path("plain").verdict == "edge" else ""  # only plan's prediction fits (DSD234)
    return Step("exit", "done", fill(SUMMARY["keep plain" + edge], stage=traced_stage), data={"path": "plain", "merged": None})


def _exit_step(path, plan_result, model, checkpoint, out: Path, gpus, merged: dict | None, tmp: Path,
               split_config: dict | None = None, traced_stage: int | None = None,
               current: str | None = None) -> Step:
    """Step 5: the path step 2 recommends, with its code and commands: leave ZeRO-3 for a plain load or for
    tensor parallelism (TP is not ZeRO-3), or keep ZeRO-3 with the config of that path (offload_param kept
    only where the path offloads). merge and verify only when there are shards (``checkpoint``); compare the
    tokens only then, against the path the config ran."""
    rec = plan_result.recommended if plan_result is not None else None
    code = getattr(rec, "code", None)  # None without a plan
    if path == "plain" and not checkpoint and traced_stage is not None and traced_stage != 3:
        return _keep_plain(plan_result, traced_stage)
    n = gpus or (plan_result.hardware.gpus if plan_result else None) or 1
    chosen = plan_result.path(path) if plan_result is not None and path else None
    shards = bool(checkpoint)
    merged_dir = shlex.quote(str(out / "merged")) if shards else "MERGED_DIR"
    cmds = _shard_commands(checkpoint, merged, merged_dir, shlex.quote(str(model)))
    data = {"path": path, "merged": merged, "code": code, "config": None}
    artifacts: list[str] = []
    if path is None or path == "plain":
        cmds += _launches(code)
        summary = _plain_summary(shards, merged)
    elif path.startswith("tp"):
        cmds += _launches(code)
        summary = _tp_summary(chosen, n)
    else:
        data["config"], cmd, summary = _zero3_exit(path, split_config, rec, out, tmp, n, artifacts)
        cmds.append(cmd)
    cmds += _compare_command(path, current, shards, chosen, n, merged_dir)
    return Step("exit", "done", summary, commands=cmds, data=data, artifacts=artifacts)


def _shard_commands(checkpoint, merged: dict | None, merged_dir: str, model_arg: str) -> list[str]:
    """When the weights are ZeRO shards: ordinary weights first (unless merged here), checked against the model."""
    if not checkpoint:
        return []
    merge = [] if merged else [f"dsdoctor merge {shlex.quote(str(checkpoint))} {merged_dir} --dtype bf16 --model {model_arg}"]
    return merge + [f"dsdoctor verify {merged_dir} --model {model_arg}"]


def _tp_summary(chosen, n: int) -> dict:
    k = (chosen.tp if chosen is not None and chosen.tp else None) or n
    replicas = chosen.replicas if chosen is not None else 1
    return fill(SUMMARY["tp groups" if replicas > 1 else "tp"], n=k, groups=replicas, total=k * replicas)


def _planned_exit(inputs: Inputs, plan_result, path, current, captured, checkpoint, split_step: Step, tmp: Path,
                  out: Path, lang) -> Step:
    """Step 5 with a plan: the shards merged here when the way out leaves ZeRO-3, then ``_exit_step``."""
    merged, merge_findings = None, []
    if checkpoint and (path is None or not path.startswith("zero3")):
        merged, merge_findings = _merge(checkpoint, inputs.model, tmp, lang)
    shown = out / "model" if captured is not None and inputs.model == captured.model_dir else inputs.model
    exit_step = _exit_step(path, plan_result, shown, checkpoint, out, inputs.gpus, merged, tmp,
                           split_config=split_step.data.get("config"), traced_stage=captured.stage if captured else None,
                           current=current)
    exit_step.findings += merge_findings
    exit_step.summary = _with_inputs(exit_step.summary, inputs.sources)
    return exit_step


def _plain_summary(shards: bool, merged: dict | None) -> dict:
    summary = fill(SUMMARY["leave zero3 shards" if shards else "leave zero3"])
    if merged:
        more = fill(SUMMARY["merged"], summary=merged.get("summary", ""))
        summary = {lang: text + more[lang] for lang, text in summary.items()}
    return summary


def _zero3_exit(path: str, split_config, rec, out: Path, tmp: Path, n: int, artifacts: list[str]) -> tuple:
    """(config, launch line, summary) of a way out that keeps ZeRO-3: the split config when it is the path's,
    else the path's own config written beside the report (its name added to ``artifacts``)."""
    cfg = _path_config(path, split_config, rec.ds_config if rec is not None else None)
    if split_config is not None and cfg == split_config:
        name, where = "ds_inference.json", fill(SUMMARY["split config"], file=out / "ds_inference.json")
    else:
        name = f"ds_{path}.json"
        door.write_new(tmp / name, to_json(cfg))
        artifacts.append(name)
        where = fill(SUMMARY["path config"], file=out / name, path=path)
    cmd = f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {shlex.quote(str(out / name))}"
    return cfg, cmd, fill(SUMMARY["keep zero3"], path=path, config=where)


def _compare_command(path, current, shards: bool, chosen, n: int, merged_dir: str) -> list[str]:
    """compare on the merged weights, the way out against the path the config ran (when both are compare's)."""
    new, old = _compare_path(path or "plain"), _compare_path(current or "")
    if not (shards and new and old and new != old):
        return []
    k = (chosen.tp if chosen is not None and chosen.tp else n) if new == "tp" else n
    return [f"dsdoctor compare {merged_dir} --paths {new},{old} --gpus {max(k, 2)}"]


def _current(check_result, captured) -> str | None:
    """The plan path the user's config (or traced run) amounts to: what "before" is."""
    if check_result is not None and check_result.inference_config is not None:
        return current_path(None, None, check_result.inference_config.tp_size)
    if check_result is not None:
        eff = check_result.effective
        return current_path(eff.zero_stage, eff.offload_param.device)
    if captured is not None and captured.stage is not None:
        tp = (captured.init_inference or {}).get("tp_size")
        return current_path(captured.stage, captured.offload_param, tp if isinstance(tp, int) else None)
    return None


def _summary(steps: list[Step], plan_result, path, current, traced, ab_result, command, checkpoint) -> Summary:
    """The answer the report leads with (report/summary.py): verdict, actions, predicted before -> after."""
    config_errors = [f for s in steps if s.key == "effective" and "trace" not in s.data for f in s.findings
                     if f.effective_severity == "error"]
    decisive = ab_result.diagnosis if ab_result is not None and ab_result.diagnosis is not None and \
        ab_result.diagnosis.code in ("DSD316", "DSD317") else None
    text = summary_verdict(failed_run=_failed_run(traced), ab=decisive, config_errors=config_errors,
                           plan_result=plan_result, path=path, current=current)
    exit_step = next((s for s in steps if s.key == "exit"), None)
    return Summary(text, _actions(exit_step, plan_result, path, command, ab_result, checkpoint),
                   *before_after(plan_result, path, current, ab_result))


def _failed_run(run) -> tuple | None:
    """(rank, {lang: how it ended}) of the rank that ended a failed traced run, from trace's endings."""
    if run is None or run.status == "ok":
        return None
    from dsdoctor.trace.ending import ending_text

    root = next((r for r in run.ranks if (r.ending or {}).get("kind") not in (None, "finished", "by-launcher")), None)
    if root is None:
        return "?", {lang: run.status for lang in LANGS}
    return root.rank, {lang: ending_text(root.ending, lang) for lang in LANGS}


def _actions(exit_step: Step | None, plan_result, path, command, ab_result, checkpoint) -> list[Action]:
    """Up to three things to do, in order: the shards into weights (when there are shards), the way out of
    step 5, then what confirms it (ab on the user's run, compare on the merged weights) or what DSD220 asks."""
    if exit_step is None or exit_step.status != "done":
        return []
    cmds = exit_step.commands
    shard_cmds = [c for c in cmds if c.startswith(("dsdoctor merge", "dsdoctor verify"))]
    compare = [c for c in cmds if c.startswith("dsdoctor compare")]
    launch = [c for c in cmds if c not in shard_cmds and c not in compare]
    out = [Action(SUMMARY_TEXT["act-shards"], shard_cmds)] if shard_cmds else []
    out.append(_way_out_action(exit_step, plan_result, path, launch))
    measure = _measure_command(plan_result, path)
    if measure:  # the way out fits by plan's prediction only (DSD234): what settles it comes right after it
        out.append(Action(SUMMARY_TEXT["act-measure"], [measure]))
    if compare:
        out.append(Action(SUMMARY_TEXT["act-compare"], compare))
    elif command and ab_result is None:
        out.append(Action(SUMMARY_TEXT["act-ab"], [f"dsdoctor ab --out ab -- {_shell(command)}"]))
    elif not command:
        out.append(Action(SUMMARY_TEXT["act-trace"], ["dsdoctor diagnose --out diag -- python your_infer.py"]))
    fragmented = plan_result is not None and any(
        f.code == "DSD220" and str(f.values.get("path")) == str(path) for f in plan_result.findings)
    if fragmented:
        out.append(Action(SUMMARY_TEXT["act-expandable"], ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]))
    return out[:3]


def _measure_command(plan_result, path) -> str | None:
    """The ``dsdoctor plan ... --measure`` line DSD234 gives when the recommended path is at the edge."""
    chosen = plan_result.path(path) if plan_result is not None and path else None
    edge = next((f for f in plan_result.findings if f.code == "DSD234"), None) if chosen is not None else None
    if chosen is None or chosen.verdict != "edge" or edge is None:
        return None
    return edge.values["measure"].values.get("command")


def _way_out_action(exit_step: Step, plan_result, path, launch: list[str]) -> Action:
    """The way out of step 5 as an action: the variant ab measured, a plain load, tensor parallel or ZeRO-3."""
    if exit_step.data.get("measured"):
        return Action(fill(SUMMARY_TEXT["act-measured"], variant=exit_step.data["measured"]), launch)
    if path is None or path == "plain":
        return Action(SUMMARY_TEXT["act-plain"], launch)
    if path.startswith("tp"):
        chosen = plan_result.path(path) if plan_result is not None else None
        return Action(fill(SUMMARY_TEXT["act-tp"], n=(chosen.tp if chosen is not None and chosen.tp else 1)), launch)
    config = launch[0].rsplit(" ", 1)[-1] if launch else "-"
    return Action(fill(SUMMARY_TEXT["act-zero3"], path=path, file=f"`{config}`"), launch)


def _merge(checkpoint, model, tmp: Path, lang) -> tuple[dict, list[Finding]]:
    from dsdoctor.checkpoint.merge import merge
    from dsdoctor.checkpoint.verify import verify

    merged = merge(checkpoint, tmp / "merged", model=model)
    checked = verify(tmp / "merged", model=model)
    summary = f"{merged.tensors} tensors written to merged/; verify: {len(checked.findings)} finding(s)."
    return {"summary": summary, "merge": merged.to_dict(lang), "verify": checked.to_dict(lang)}, list(checked.findings)


def _measured_exit(ab_result, inputs: Inputs, tmp: Path, out: Path) -> Step:
    """Step 5 without a plan: the variant ab measured as the fix (DSD316), its config written beside the report."""
    fix = ab_result.diagnosis if ab_result is not None else None
    if fix is None or fix.code != "DSD316":
        return _skipped("exit", SKIPPED["no plan"])
    from dsdoctor.trace.variants import apply_variant

    name = str(fix.values["variant"])
    variant = next(v for v in ab_result.variants if v.name == name)
    n = inputs.gpus or (variant.shape or {}).get("world_size") or 1
    cfg = apply_variant(name, inputs.loaded.raw) if inputs.loaded is not None else None
    if cfg is not None:
        door.write_new(tmp / f"ds_{name}.json", to_json(cfg))
    cmds = [f"deepspeed --num_gpus {n} your_infer.py --deepspeed_config {shlex.quote(str(out / f'ds_{name}.json'))}"]
    summary = fill(SUMMARY["measured way out"], variant=name, fix={x: fix.fix(x) for x in LANGS},
                   tps=f"{variant.tokens_per_s:.1f}" if variant.tokens_per_s else "-")
    return Step("exit", "done", _with_inputs(summary, inputs.sources), commands=cmds if cfg else [],
                artifacts=[f"ds_{name}.json"] if cfg else [], data={"path": None, "measured": name, "config": cfg})
