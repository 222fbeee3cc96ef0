"""The algorithms: pure functions over [B, T] right-padded tensors, selected by name from registries.

  advantages     ESTIMATORS by --algo.advantage.estimator, each with its Needs; compute_advantages(cfg.algo, ...)
  losses         LOSSES by --actor.loss_mode; policy_loss(cfg, ...) and value_loss(...) per micro-batch,
                 each returning its share of the step's global token-mean
  is_correction  is_weights(): engine-vs-trainer importance weights (TIS, IcePop, sequence gates)
  kl             KL_ESTIMATORS k1/k2/k3, kl_penalty(), KLController (fixed or adaptive, checkpointable)
  filters        dynamic_filter(): DAPO group filter

Adding an estimator is one function, its row in ESTIMATORS with what it needs, its name in the flag's help
and one golden test; adding a loss is one registered function, one name in the config Literal (a test checks
the two agree), one metric and one golden test.
"""

from instar.algo.advantages import ESTIMATORS, AdvantageInputs, Estimator, Needs, compute_advantages, registered
from instar.algo.filters import dynamic_filter
from instar.algo.is_correction import check_is_correction, is_weights
from instar.algo.kl import KL_ESTIMATORS, KLController, kl_penalty
from instar.algo.losses import LOSSES, policy_loss, value_loss

__all__ = ["ESTIMATORS", "AdvantageInputs", "Estimator", "Needs", "compute_advantages", "registered", "dynamic_filter",
           "check_is_correction", "is_weights", "KL_ESTIMATORS", "KLController", "kl_penalty", "LOSSES", "policy_loss",
           "value_loss"]
