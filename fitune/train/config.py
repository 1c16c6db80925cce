"""Moved: TrainConfig and DataConfig live in fitune/config.py (the spine); this name stays for old imports."""

from ..config import DATA_FORMATS, SCHEDULES, DataConfig, TrainConfig, config_from_dict  # noqa: F401
