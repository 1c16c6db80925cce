import os
import sys

from .cli.main import main

code = main()
if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_RANK") is not None:
    # A rank of `fitune train --gpus N` (torchrun's worker): everything is written and the process group is gone.
    # Leave without the interpreter's teardown, where gloo's worker threads can still hold tensors and abort the
    # process (SIGABRT, "terminate called without an active exception"; pytorch/pytorch PR 179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
