"""Every setting of instar, as nested dataclasses: the single source of truth for CLI flags
(``--actor.model_name_or_path``), YAML recipes and ``--help``. The docstring under each field is its
help text. Flag names follow Molt's where Molt has the concept. One module per group of sections.

Layer 0 (stdlib only), beside the contract: every layer reads its own section from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from instar.config.algo import AdvantageConfig, AlgoConfig, KLConfig
from instar.config.cpu import CpuConfig
from instar.config.data import DataConfig, SFTSection
from instar.config.policy import ActorConfig, CriticConfig
from instar.config.rollout import EngineConfig, RolloutConfig
from instar.config.run import CkptConfig, EvalConfig, LogConfig, RayConfig
from instar.config.trainer import FSDPConfig, TrainConfig

__all__ = ["ALIASES", "ActorConfig", "AdvantageConfig", "AlgoConfig", "CkptConfig", "ConfigError", "CpuConfig",
           "CriticConfig", "DataConfig", "EngineConfig", "EvalConfig", "FSDPConfig", "KLConfig", "LogConfig",
           "RLConfig", "RayConfig", "RolloutConfig", "SFTConfig", "SFTSection", "TrainConfig", "VALUE_ALIASES"]


@dataclass
class RLConfig:
    """`instar rl`: train a policy with reinforcement learning."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)


@dataclass
class SFTConfig:
    """`instar sft`: supervised fine-tuning, loss on assistant tokens only."""

    actor: ActorConfig = field(default_factory=ActorConfig)
    sft: SFTSection = field(default_factory=SFTSection)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)


ALIASES = {"vllm.": "engine.", "rollout.vllm_generate_batch_size": "rollout.max_groups_in_flight",
           "fsdp.cpu_matmul": "cpu.matmul"}
"""Molt's flag spellings, and earlier instar ones (dotted prefixes or whole names), and the ones they mean here;
accepted on the command line and as YAML recipe keys."""

VALUE_ALIASES = {"engine.compile": ("cpu.enable", {"aot": True, "none": False})}
"""Earlier flags whose values map onto another flag's: ``--engine.compile aot`` is ``--cpu.enable true``."""


class ConfigError(ValueError):
    """An invalid or incompatible combination of settings; the message names the fix (see `instar.checks`)."""
