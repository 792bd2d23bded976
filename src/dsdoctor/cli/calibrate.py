"""``dsdoctor calibrate``: measure this machine's bandwidths, overheads and FLOP/s for plan's models."""
from __future__ import annotations

from dsdoctor.cli.common import SECONDS, add_command, add_output_flags, emit

EXAMPLES = """\
  dsdoctor calibrate                          # about a minute; caches ~/.cache/dsdoctor/machine-<fingerprint>.json
  dsdoctor calibrate --out h200.json          # also write a copy to take elsewhere (plan --machine h200.json)
  dsdoctor calibrate --nvme-path /local_nvme  # also time reads where offload_param would swap
  dsdoctor env --calibrate                    # the same, from env"""


def register(sub):
    p = add_command(
        sub, "calibrate", "measure this machine (bandwidths, overheads, FLOP/s) for plan and diagnose", EXAMPLES,
        description="Measure, in about a minute, what plan's speed and memory models need: pinned and pageable "
                    "host<->device bandwidth, HBM bandwidth, bf16 matmul throughput, eager per-layer and "
                    "per-token generate overhead, ZeRO-3's per-module hook cost, NCCL all-gather/all-reduce "
                    "between GPUs, the CUDA context, and the read bandwidth of --nvme-path. Writes the machine "
                    "profile that plan and diagnose then use on this machine. Without a GPU it measures what "
                    "it can and says what it could not.",
    )
    add_flags(p)
    add_output_flags(p, fail_on=False)
    p.set_defaults(func=run)


def add_flags(p):
    p.add_argument("--out", default=None, help="also write the profile to this file")
    p.add_argument("--force", action="store_true", help="replace the --out file if it exists")
    p.add_argument("--nvme-path", default=None, help="a directory on the NVMe drive offload would use")
    p.add_argument("--no-cache", action="store_true", help="do not write the per-machine cache file")
    p.add_argument("--budget-s", type=SECONDS, default=60.0, help="time budget in seconds (default: 60)")


def run(args) -> int:
    from dsdoctor.calibrate.api import calibrate

    result = calibrate(out=args.out, nvme_path=args.nvme_path, budget_s=args.budget_s, cache=not args.no_cache,
                       force=args.force)
    emit(result, args)
    return 0
