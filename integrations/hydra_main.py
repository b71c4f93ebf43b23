"""Hydra main for train.py: compose the config from recipes/, validate it, run the chosen framework trainer.

No working-directory change and no outputs/ folder (see recipes/config.yaml `hydra:`). The config directory is
``recipes/`` next to the repository root, or ``$PRIMUS_TURBO_RECIPES`` when set (an installed, non-editable
package has no repository root).
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from omegaconf import DictConfig

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
RECIPES_DIR = os.environ.get("PRIMUS_TURBO_RECIPES", os.path.join(_REPO_ROOT, "recipes"))


def resolve_repo_paths(cfg: DictConfig) -> None:
    """A relative data.path that does not exist from the cwd is taken relative to the repository root."""
    path = cfg.data.get("path")
    if path and not os.path.isabs(path) and not os.path.exists(path):
        candidate = os.path.join(_REPO_ROOT, path)
        if os.path.exists(candidate):
            cfg.data.path = candidate


def run(cfg: DictConfig) -> dict:
    """Validate ``cfg`` and run its framework's trainer. Returns the trainer's summary dict."""
    from primus_turbo.integrations.common.config import ConfigError, validate_config

    try:
        resolve_repo_paths(cfg)
        validate_config(cfg)
        framework = cfg.framework.name
        if framework == "megatron":
            from primus_turbo.integrations.megatron.trainer import train

            return train(cfg)
        if framework == "torchtitan":
            from primus_turbo.integrations.torchtitan.trainer import train as train_torchtitan

            return train_torchtitan(cfg)
        raise ConfigError(f"framework={framework}: expected megatron or torchtitan")
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: configuration error: {err}", file=sys.stderr, flush=True)
        else:  # every rank hits the same error; torchrun stops the others when one exits, so let rank 0
            time.sleep(3)  # print it first (a rank exiting at once raced it: the message could be lost)
        raise SystemExit(2) from None


@hydra.main(version_base="1.3", config_path=RECIPES_DIR, config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    _hydra_entry()
