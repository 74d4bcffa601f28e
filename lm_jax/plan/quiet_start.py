"""A quiet start for --mode=compile: libtpu and the compile-only CUDA plugin write 5-13 lines of start-up noise
straight to file descriptor 2 (C++ logging, before Python sees anything), an `E0000 ... INVALID_ARGUMENT` among
them, even when the compile succeeds. Imported before JAX is.

- libtpu looks for the TPU VM it runs on (metadata server, worker hostnames, accelerator type) and logs each miss:
  the environment tells it there is one host and no metadata server (ENV; a value already set is kept).
- The CUDA plugin logs 'Could not find cuda drivers' on import and at backend start, through a logger that no
  environment variable quiets: stderr passes through a filter that drops exactly those lines (NOISE), all else
  unchanged.
"""
import atexit
import os
import re
import sys
import threading

# TPU_ACCELERATOR_TYPE by the --topology's chip (any slice name quiets libtpu; the chip's own is the least surprising).
ACCELERATOR_TYPES = {"v4": "v4-8", "v5p": "v5p-8", "v5e": "v5litepod-8", "v6e": "v6e-8"}
ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}
NOISE = re.compile(rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                   rb"|WARNING: Logging before InitGoogle\(\) is written to STDERR"
                   rb"|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine")


def wanted(argv: list[str]) -> bool:
  """Whether the command line asks for --mode=compile."""
  return "--mode=compile" in argv or any(a == "--mode" and b == "compile" for a, b in zip(argv, argv[1:]))


def install(argv: list[str]):
  """Sets ENV (and the accelerator type of argv's --topology) and filters NOISE out of stderr until exit."""
  topology = next((a.split("=", 1)[1] for a in argv if a.startswith("--topology=")), "")
  chip = re.sub(r"^\d+x", "", topology.lower()).split("-")[0]
  for key, value in {**ENV, "TPU_ACCELERATOR_TYPE": ACCELERATOR_TYPES.get(chip, "v5litepod-8")}.items():
    os.environ.setdefault(key, value)
  read_end, write_end = os.pipe()
  original = os.dup(2)
  os.dup2(write_end, 2)
  os.close(write_end)

  def pump():
    with os.fdopen(read_end, "rb") as lines, os.fdopen(os.dup(original), "wb", buffering=0) as out:
      for line in lines:
        if not NOISE.match(line):
          out.write(line)
  thread = threading.Thread(target=pump, name="quiet_start", daemon=True)
  thread.start()

  def restore():   # the last atexit handler: every line written before it has been through the filter
    sys.stderr.flush()
    os.dup2(original, 2)   # the pipe's last write end closes: the pump reads to its end
    thread.join(timeout=5)
  atexit.register(restore)
