"""The one door for files: every read of an untrusted file and every write of an output goes through here.

No other module of dsdoctor opens, reads, writes, copies, renames or deletes a file (``tests/door/test_enforced.py``
parses every module and fails on one that does); the guards are declared per kind of file in
``door.kinds`` (sizes, encodings, tree bounds for inputs; marker, ``--force`` rules, building aside and the
mode for outputs). Light on purpose: it imports only the standard library and ``dsdoctor.errors``, so the
code that runs inside the user's ranks (the trace observer, compare's runner, calibrate's NCCL worker) uses
it too.

Reading (``door.read``): ``require_regular``, ``open_fd``, ``open_binary``, ``read_bytes``, ``read_text``,
``read_json``, ``read_head``, ``read_tail``, ``iter_lines``, ``check_tree``, ``map_readonly``; kernel files
``read_proc``, ``proc_lines``; files a library opens by name ``check_library_files``, ``load_torch_weights``,
``safetensors_reader``.

Writing (``door.write``): output folders ``atomic_output_dir``, output files ``atomic_write_text``, checked
early with ``check_output_path``; new files inside a folder being built ``write_new``, ``open_new``,
``create_fd``, ``copy_file``, ``remove_own``, ``make_dir``. Multi-node trace (``door.shared``):
``shared_root``, ``live_output_dir``, ``check_publish``, ``publish_into``. Private and own files
(``door.scratch``): ``scratch_dir``, ``probe_file``, ``check_cache_file``, ``write_cache_file``; in the ranks
``record_file``, ``write_record``.
"""
from __future__ import annotations

from dsdoctor.door.kinds import (
    COMPARE_JOB,
    COMPARE_RECORD,
    DS_CONFIG,
    FIGURE,
    INPUTS,
    LATEST,
    MACHINE_PROFILE,
    MODEL_CONFIG,
    MODEL_FILE,
    NCCL_RESULT,
    NODE_RECORD,
    OUTPUTS,
    PACKAGE_DATA,
    PROBE,
    PROMPTS,
    RANK_FILE,
    RUN_LOG,
    SAFETENSORS,
    STACK_DUMP,
    TRACE_RECORD,
    WEIGHTS_BIN,
    WEIGHTS_INDEX,
    Kind,
    OutputKind,
)
from dsdoctor.door.marker import MARKER, foreign_entries, note_stale, stale_siblings
from dsdoctor.door.read import (
    check_library_files,
    check_tree,
    decode,
    file_kind,
    iter_lines,
    load_torch_weights,
    map_readonly,
    open_binary,
    open_fd,
    proc_lines,
    read_bytes,
    read_head,
    read_json,
    read_proc,
    read_tail,
    read_text,
    require_regular,
    safetensors_reader,
)
from dsdoctor.door.scratch import (
    check_cache_file,
    devnull_onto,
    probe_file,
    record_file,
    remove_shm_file,
    scratch_dir,
    write_cache_file,
    write_record,
)
from dsdoctor.door.shared import check_publish, live_output_dir, publish_into, shared_root
from dsdoctor.door.signals import SIGNALS, Interrupted
from dsdoctor.door.write import (
    LOCK_SUFFIX,
    atomic_output_dir,
    atomic_write_text,
    check_output_path,
    copy_file,
    create_fd,
    free_bytes,
    make_dir,
    open_new,
    output_lock,
    remove_own,
    umask,
    write_new,
)

__all__ = [
    "COMPARE_JOB",
    "COMPARE_RECORD",
    "DS_CONFIG",
    "FIGURE",
    "INPUTS",
    "Interrupted",
    "Kind",
    "LATEST",
    "LOCK_SUFFIX",
    "MACHINE_PROFILE",
    "MARKER",
    "MODEL_CONFIG",
    "MODEL_FILE",
    "NCCL_RESULT",
    "NODE_RECORD",
    "OUTPUTS",
    "OutputKind",
    "PACKAGE_DATA",
    "PROBE",
    "PROMPTS",
    "RANK_FILE",
    "RUN_LOG",
    "SAFETENSORS",
    "SIGNALS",
    "STACK_DUMP",
    "TRACE_RECORD",
    "WEIGHTS_BIN",
    "WEIGHTS_INDEX",
    "annotations",
    "atomic_output_dir",
    "atomic_write_text",
    "check_cache_file",
    "check_library_files",
    "check_output_path",
    "check_publish",
    "check_tree",
    "copy_file",
    "create_fd",
    "decode",
    "devnull_onto",
    "file_kind",
    "foreign_entries",
    "free_bytes",
    "iter_lines",
    "live_output_dir",
    "load_torch_weights",
    "make_dir",
    "map_readonly",
    "note_stale",
    "open_binary",
    "open_fd",
    "open_new",
    "output_lock",
    "probe_file",
    "proc_lines",
    "publish_into",
    "read_bytes",
    "read_head",
    "read_json",
    "read_proc",
    "read_tail",
    "read_text",
    "record_file",
    "remove_own",
    "remove_shm_file",
    "require_regular",
    "safetensors_reader",
    "scratch_dir",
    "shared_root",
    "stale_siblings",
    "umask",
    "write_cache_file",
    "write_new",
    "write_record",
]
