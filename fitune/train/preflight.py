"""What stops `fitune train`, said before anything loads: the checks that need more than the spine (the machine
through `fitune.runtime.needs` and `fitune.parallel.launch`, the data's first records through `fitune.data`), added
to the spine's own (`fitune.config.source_problems`). They sit here, above `fitune.config`, so that the spine imports
nothing above it (tests/test_layering.py). Pure Python at import; torch only when a check needs a CUDA answer.
"""

from __future__ import annotations

import os

from ..config import TrainConfig, source_problems
from ..data.encode import check_first_records
from ..errors import ConfigError, DataError
from ..parallel import CPU_RANKS_ENV, ZERO_STRATEGIES
from ..parallel.launch import needs_launch, preflight
from ..runtime import needs as runtime_needs  # has_module, cuda_available: looked up when called (tests replace them)
from ..runtime.needs import flash_dtype_problem, machine_problems, memory_problems, needs_of
from ..setup import TrainSetup


def preflight_problems(cfg: TrainConfig) -> list[str]:
    """What stops `fitune train`, every problem at once, said before anything loads (torch, the tokenizer, the
    data, the model) rather than after:

    - the model: a folder (or a Hub id's cached snapshot) without config.json, or without a weights file for init:
      pretrained; a Hub id (model or tokenizer) that is not cached while HF_HUB_OFFLINE is set (a config naming
      such a model is still valid: the files may be downloaded later): `fitune.config.source_problems`;
    - the machine: options that need a CUDA GPU it lacks, every missing package (one pip command for all:
      `fitune.runtime.needs`), and for several GPUs or DeepSpeed what `fitune.parallel.launch.preflight` checks;
    - the data: the first records of data.path and data.eval_path against data.format
      (`fitune.data.encode.check_first_records`);
    - memory: host RAM for loading and saving against what this machine has free, and a warning for each phase
      (eval, save, merge) over the GPU's budget (`fitune.runtime.needs.memory_problems`, docs/phases.md).
    """
    problems = source_problems(cfg) + _machine_problems(cfg)
    if not problems:  # the memory check needs a model it can read, and a machine that can run the options
        problems += _memory_problems(cfg)
    return problems + _data_peek_problems(cfg)


def _memory_problems(cfg: TrainConfig) -> list[str]:
    """Host RAM and each phase against the GPU (fitune/memory/phases.py); torch imported only with a CUDA option
    or when torch is there to ask."""
    on_cuda = runs_on_cuda(cfg.setup) if runtime_needs.has_module("torch") else False
    return memory_problems(cfg, on_cuda)


def _machine_problems(cfg: TrainConfig) -> list[str]:
    """Options this machine cannot run (a CUDA GPU, packages: `fitune.runtime.needs`), and for several GPUs or
    DeepSpeed the launcher's own checks (GPU count, DeepSpeed installed, the strategy's methods)."""
    needs = needs_of(cfg.setup, cfg.report_to)
    on_cuda = runs_on_cuda(cfg.setup) if any(n.cuda for n in needs) else True  # torch imported only if needed
    problems = machine_problems(needs, on_cuda)
    if cfg.setup.attn == "flash" and flash_dtype_problem(cfg.setup.dtype):
        problems.append(flash_dtype_problem(cfg.setup.dtype))
    # (without torch, the missing package is the problem)
    if needs_launch(cfg.setup) and runtime_needs.has_module("torch"):
        try:
            preflight(cfg)
        except ConfigError as exc:
            problems += exc.problems
    return problems


def runs_on_cuda(s: TrainSetup) -> bool:
    """Whether `fitune train` runs `s` on a CUDA GPU here: torch sees one, and the run is not a CPU rehearsal of
    several ranks (FITUNE_CPU_RANKS=1: fitune/parallel/ranks.py trains them on the CPU). Imports torch."""
    rehearsal = os.environ.get(CPU_RANKS_ENV) == "1" and (s.num_gpus > 1 or s.strategy in ZERO_STRATEGIES)
    return not rehearsal and runtime_needs.cuda_available()


def _data_peek_problems(cfg: TrainConfig) -> list[str]:
    """The first records of each local data file read and checked against data.format (no tokenizer needed)."""
    problems = []
    for path in dict.fromkeys(p for p in (cfg.data.path, cfg.data.eval_path) if p and os.path.isfile(p)):
        try:
            check_first_records(path, cfg.data.format, split=cfg.data.split, subset=cfg.data.subset)
        except DataError as exc:
            problems.append(str(exc))
    return problems
