"""One rank of calibrate's collective measurements (NCCL): all-gather and all-reduce bus bandwidth and
latency, and the small all-reduce AutoTP runs twice per layer. Launched by ``dsdoctor calibrate`` as
``python -m torch.distributed.run --nproc_per_node N -m dsdoctor.calibrate.nccl_worker OUT.json``.

Bus bandwidth as nccl-tests defines it: all-gather moves (n-1)/n of the output per rank, all-reduce
2(n-1)/n of the buffer.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    out_path = (argv or sys.argv[1:])[0]
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = dist.get_world_size()

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    res = {"world": n, "all_gather": {}, "all_reduce": {}}
    for size in (64 * 1024, 4 * 2**20, 64 * 2**20, 256 * 2**20):
        out = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
        shard = torch.empty(size // 2 // n, dtype=torch.bfloat16, device="cuda")
        t = timed(lambda out=out, shard=shard: dist.all_gather_into_tensor(out, shard), 10)
        res["all_gather"][size] = {"s": t, "bus_bytes_per_s": size * (n - 1) / n / t}
        t = timed(lambda out=out: dist.all_reduce(out), 10)
        res["all_reduce"][size] = {"s": t, "bus_bytes_per_s": 2 * size * (n - 1) / n / t}
    small = torch.empty(8192, dtype=torch.bfloat16, device="cuda")  # one decode step's (batch, hidden) at 1-2 seqs
    res["all_reduce_latency_s"] = timed(lambda: dist.all_reduce(small), 50)
    res["all_gather_latency_s"] = timed(lambda: dist.all_gather_into_tensor(
        torch.empty(8192, dtype=torch.bfloat16, device="cuda"), small[: 8192 // n]), 50)
    try:  # AutoTP all-reduces through deepspeed.comm (LinearAllreduce -> inference_all_reduce)
        import deepspeed
        import deepspeed.comm as dscomm

        deepspeed.init_distributed(dist_backend="nccl")
        res["autotp_all_reduce_s"] = timed(lambda: dscomm.inference_all_reduce(small), 50)
    except Exception as exc:  # recorded, not fatal: torch's figure stands in
        res["autotp_all_reduce_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if dist.get_rank() == 0:
        from dsdoctor import door

        door.write_record(out_path, json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
