"""Learner configuration (owned by the learning package)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializeAsAny, field_validator, model_validator

from rollway.base.config import StrictModel
from rollway.base.plugins import PluginRef
from rollway.base.registry import validate_section
from rollway.learning.registries import ADVANTAGES, LOSSES
from rollway.learning.scale_config import DistConfig, LoraConfig

AdvantageName = Literal["grpo", "rloo", "drgrpo"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "token-sum-norm"]


class LossConfig(StrictModel):
    """`learner.loss`: the objective and, for a plugin with a `config_class` (a subclass of this), its
    options. The plain form `loss: cispo` is `loss: {type: cispo}`."""


    type: Literal["ppo", "cispo", "gspo"] | PluginRef = "ppo"
    """Per-token objective (learning/losses.py). `ppo`: clipped ratio (clip-higher, dual-clip). `cispo`:
    clipped, stop-gradient IS weight times log-prob (every token keeps a gradient). `gspo`: one clipped
    ratio per sequence (set small clip_eps_*). `python:MODULE:CLASS`: your own `Loss` subclass, built as
    `Class(learner_config)` (its options at `learner_config.loss`)."""


class AdvantageConfig(StrictModel):
    """`learner.advantage`: the estimator and, for a plugin with a `config_class` (a subclass of this),
    its options. The plain form `advantage: rloo` is `advantage: {type: rloo}`."""


    type: AdvantageName | PluginRef = "grpo"
    """`grpo`: (r - group mean) / (group std + eps). `rloo`: r minus the mean of the other
    episodes of the group. `drgrpo`: r - group mean, no std division (pairs with token-sum-norm).
    `python:MODULE:CLASS`: your own AdvantageEstimator subclass, built as `Class(learner_config)` (its
    options at `learner_config.advantage`)."""


def _by_type(data: Any, default: type[BaseModel], registry: Any) -> Any:
    return validate_section({"type": data} if isinstance(data, str) else data, default, registry)


class LearnerConfig(StrictModel):
    """The learner actor's settings. `type: record` only records; `type: ppo` trains (PPO-clip
    objective on group-relative advantages, i.e. GRPO / RLOO / Dr.GRPO by `advantage`)."""


    type: Literal["record", "ppo", "grpo"] | PluginRef = "record"
    """`record`: keep what arrives (no training). `ppo`: train with the clipped policy-gradient
    objective; `grpo` is an alias of `ppo` (the estimator is chosen by `advantage`).
    `python:MODULE:CLASS`: your own Trainer subclass (learning/registries.py, LEARNERS), which trains;
    its `config_class` (a LearnerConfig subclass) may add options."""

    # --- model and device ---
    model_path: str | None = None
    """Policy weights: a local Hugging Face folder or a `.gguf` file. None uses the policy
    loader's default model (SmolLM2-135M-Instruct)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` picks CUDA when available, else CPU."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the weights are kept in (and saved in). float32 keeps small AdamW updates; bfloat16
    is about 4x faster on CPUs with AMX but drops updates below ~1/256 of a weight (small lr)."""
    autocast_bf16: bool = False
    """Run forward/backward under bf16 autocast (weights stay in `dtype`)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the inference engine; logits are divided by it so the learner's
    logprobs are those of the behaviour distribution. Keep equal to `agent.temperature`."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory on long episodes."""

    # --- batching ---
    group_size: int | None = Field(None, ge=1)
    """Episodes per group; a group is complete when this many distinct episodes arrived.
    None: the actor passes `scheduler.group_size`."""
    groups_per_step: int = Field(1, ge=1)
    """Complete groups buffered before one update (one policy version) runs."""
    group_timeout_s: float | None = Field(None, gt=0)
    """A group still incomplete this long after its first episode arrived is trained with what it
    has (when at least 2 episodes) or dropped. The learner's own updates do not count (it reads nothing
    meanwhile), and a member arriving after its group was taken is consumed without training. At least
    `scheduler.episode_deadline_s` plus the task set's longest grading limit when the learner trains (a
    shorter one is refused when the run starts: a member that is merely slow, as a policy can be on purpose,
    would have its 0 left out). None: wait (the scheduler re-issues lost episodes)."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget (rows x padded length) of one forward/backward; gradients are accumulated
    over micro-batches. A longer single episode still gets its own micro-batch."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per update: the batch is split into this many mini-batches."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the batch per update. With mini_batches = ppo_epochs = 1 the update is a single
    on-policy step (old logprobs = current, detached) and needs no extra forward pass."""

    # --- optimizer ---
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this before each optimizer step. None: no clipping."""

    # --- advantages ---
    advantage: SerializeAsAny[AdvantageConfig] = Field(default_factory=AdvantageConfig)
    """The advantage estimator (`grpo`, `rloo`, `drgrpo` or `python:MODULE:CLASS`; AdvantageConfig), as a
    name or as a mapping with `type` and the plugin's own options."""
    adv_eps: float = Field(1e-6, gt=0)
    """Added to the group std in `grpo`."""
    drop_degenerate_groups: bool = False
    """Drop groups whose rewards are all equal (their advantage is zero anyway) from the batch,
    so they cost no compute and do not dilute the token-mean."""
    masked_stop_reasons: list[str] = Field(default_factory=lambda: ["length", "max_tokens", "error:*"])
    """fnmatch patterns on `stop_reason`: such episodes (truncated or failed) get no loss."""
    masked_in_baseline: bool = True
    """Whether masked episodes still count in their group's baseline (mean/std)."""

    # --- objective ---
    loss: SerializeAsAny[LossConfig] = Field(default_factory=LossConfig)
    """The per-token objective (`ppo`, `cispo`, `gspo` or `python:MODULE:CLASS`; LossConfig), as a name
    or as a mapping with `type` and the plugin's own options (`loss: {type: python:m:MyLoss, beta: 0.1}`)."""
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip: ratio below 1 - eps_low stops the push-down of negative-advantage tokens."""
    clip_eps_high: float = Field(0.28, ge=0)
    """Upper clip (clip-higher, DAPO): ratio above 1 + eps_high stops positive-advantage updates."""
    dual_clip_c: float | None = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages: the per-token loss is at most -c * A. None: off."""
    loss_agg: LossAgg | None = None
    """`token-mean`: mean over all loss tokens of the batch. `seq-mean-token-mean`: mean per
    episode, then over episodes. `token-sum-norm`: token sum / (loss_norm_tokens x episodes).
    None: `token-sum-norm` for `drgrpo`, else `token-mean`."""
    loss_norm_tokens: int = Field(4096, ge=1)
    """The constant of `token-sum-norm` (Dr.GRPO); set it near `agent.max_total_tokens`."""
    tis_cap: float | None = Field(2.0, gt=0)
    """Truncated importance sampling: each token's loss is weighted by min(pi_old / mu, tis_cap),
    mu the behaviour (inference) logprob. None: no correction."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a k3 KL penalty to the initial (reference) policy; > 0 keeps a frozen copy."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of an entropy bonus (subtracted from the loss)."""

    # --- staleness ---
    max_policy_lag: int | None = Field(None, ge=0)
    """An episode whose lag (trainer version - oldest turn policy version) exceeds this is
    dropped or down-weighted (`stale_policy`). None: no bound."""
    stale_policy: Literal["drop", "downweight"] = "drop"
    """What happens to an episode over `max_policy_lag`."""
    stale_weight: float = Field(0.5, ge=0, le=1)
    """Loss weight of a stale episode under `downweight`."""

    # --- checkpoints and logging ---
    checkpoint_every: int = Field(1, ge=1)
    """Save a loadable weights folder every this many updates (each saved update is published)."""
    checkpoint_idle_s: float | None = Field(3.0, gt=0)
    """Also checkpoint when updates are waiting for one (`checkpoint_every` > 1) and no input arrived
    for this long: the learner commits offsets only behind a checkpoint, so without this the end of
    a run would stay uncommitted. None: only every `checkpoint_every` updates and at shutdown."""
    keep_checkpoints: int | None = Field(3, ge=1)
    """Keep this many newest checkpoint folders; None keeps all."""
    save_optimizer: bool = True
    """Save the AdamW state next to the weights (needed for an exact resume)."""
    tensorboard: bool = True
    """Write metrics to TensorBoard in run_dir/tb besides run_dir/metrics.jsonl."""
    seed: int = 0
    """Seed for the learner's torch RNG."""
    dedup_window: int = Field(100_000, ge=1)
    """Episode ids the learner remembers (in its checkpoints) to ignore a second trajectory of an
    episode it already consumed (a redelivery, or a re-issued attempt that also finished). Bounded:
    a duplicate arriving after this many newer episodes is not recognised."""

    # --- beyond one process (learning/distributed.py, learning/packing.py, learning/lora.py) ---
    dist: DistConfig = Field(default_factory=DistConfig)
    """Learner ranks and FSDP2 sharding."""
    pack_sequences: bool = False
    """Pack episodes into rows of `micro_batch_tokens` tokens (no padding; attention and positions
    restart at each episode) instead of right-padding one episode per row. Not with `loss: gspo` (its
    ratio is one per sequence, and a packed row holds several)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (adapter-only training, checkpoints and engine sync)."""

    @field_validator("loss", mode="before")
    @classmethod
    def _loss_by_type(cls, data: Any) -> Any:
        return _by_type(data, LossConfig, LOSSES)

    @field_validator("advantage", mode="before")
    @classmethod
    def _advantage_by_type(cls, data: Any) -> Any:
        return _by_type(data, AdvantageConfig, ADVANTAGES)

    @model_validator(mode="after")
    def _packing_fits_the_loss(self) -> LearnerConfig:
        if self.pack_sequences and self.loss.type == "gspo":
            raise ValueError("learner.loss gspo takes one importance ratio per sequence, and learner.pack_sequences "
                             "puts several sequences in a row: turn pack_sequences off or use ppo or cispo")
        return self

    @property
    def trains(self) -> bool:
        """True for a learner that updates weights (every type but `record`)."""
        return self.type != "record"

    @property
    def effective_loss_agg(self) -> LossAgg:
        """`loss_agg`, or the estimator's natural pairing when unset."""
        if self.loss_agg is not None:
            return self.loss_agg
        return "token-sum-norm" if self.advantage.type == "drgrpo" else "token-mean"
