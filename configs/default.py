"""The default recipe: the seed document's small CNN on real handwritten digits, in fp16.

The digits are the 1797 8x8 images that ship inside scikit-learn, prepared once as a tfds dataset
on the local disk, so this recipe needs no download. Every other recipe overrides this file.

  python -m jamp.train                                       # this recipe, a fresh ./runs/ workdir
  python -m jamp.train --config=configs/default.py:smoke     # a few steps, for tests
  python -m jamp.train --config.policy=mixed_bfloat16 --workdir=/tmp/digits_bf16
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the recipe; ``variant="smoke"`` gives a tiny run of the same recipe."""
    c = ml_collections.ConfigDict()
    c.model = "seed_cnn"
    c.model_config = ml_collections.ConfigDict()  # keyword arguments of the model's constructor
    c.dataset = "digits"
    c.data_dir = ""  # empty: tfds's default (~/tensorflow_datasets or $TFDS_DATA_DIR)
    c.seq_len = 128  # token datasets only
    c.download = True  # let tfds download a missing dataset (needs a network)

    c.policy = "mixed_float16"
    # Where float32 values between matmuls live under a 16-bit policy: auto (float32 on CPUs, the
    # compute dtype on GPUs/TPUs) | float32 | compute. See jamp.wrap.
    c.activations = "auto"
    c.loss_scale = "auto"  # auto (dynamic for fp16, none otherwise) | dynamic | static | none
    c.loss_scale_params = ml_collections.ConfigDict(
        {
            "initial": 2.0**16,  # also the value of a static scale
            "growth_interval": 2000,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "hysteresis": 1,
            "min_scale": 1.0,
            "max_scale": 2.0**24,
        }
    )
    # Persistent overflow: this many steps in a row skipped for non-finite gradients while the loss
    # scale cannot back off further (a dynamic scale at min_scale; a static or no scale always).
    # Skipped steps leave the params as they were, so such a run will not recover on its own. 100
    # rides out a short stretch of bad batches yet wastes little; it is checked at log points.
    c.on_persistent_overflow = "stop"  # stop (exit status 3) | warn (a line on stderr, go on)
    c.persistent_overflow_steps = 100
    # On a skipped step, re-run its batch forward with every module's output checked and log the
    # first module whose output was non-finite (the step itself already logs which modules'
    # gradients were). Off by default: it waits for the device after every step.
    c.trace_nonfinite = False
    # Profile this many steps (after one warm-up step) at the start of the run: device time per
    # module and per dtype class (16-bit / fp32 matmul, convolution, elementwise, collectives) as
    # a share of the step, written to profile.txt / .png / .json in the workdir. 0: off.
    c.profile_steps = 0
    # fp8 policies (mixed_fp8): how matmul operands are scaled into fp8. delayed: from the largest
    # amax of the last fp8_history steps, kept in the train state (checkpointed); current: from
    # this step's amax (the state then only records amaxes, for the metrics). Scales are
    # fmax / (amax * 2**fp8_margin).
    c.fp8_recipe = "delayed"
    c.fp8_history = 16
    c.fp8_margin = 0.0
    # Adaptive precision (jamp.adaptive): a module blamed for overflows on k of the last n steps,
    # or at the loss scale's floor, moves up a rung (float16 -> bfloat16 where bf16 matmuls are
    # native, else float32; bfloat16 -> float32), decided every k steps and at checkpoints; each
    # change is logged, checkpointed and listed in the summary. demote_after m > 0 moves it back
    # after m steps without overflow. linen models with float16 / bfloat16 policies.
    c.adaptive_precision = False
    c.adaptive = ml_collections.ConfigDict({"k": 6, "n": 50, "demote_after": 0})
    # Static placement: modules computing in float32 whatever the policy, as path patterns
    # ("Dense_1", "DecoderBlock_*/attn*") and first:N / last:N (the first / last N repeated
    # blocks), comma-separated, e.g. "first:1,last:1".
    c.keep_in_float32 = ""

    # pmap (jamp.parallel: every device holds the whole state) | sharded (jit on a device mesh,
    # the state split over its fsdp axis: jamp.sharding); mesh: the sharded run's axis sizes over
    # data, fsdp, tensor (-1: the devices left over), e.g. "data=2,fsdp=4".
    c.parallelism = "pmap"
    c.mesh = "fsdp=-1"

    c.batch_size = 64  # global, over all local devices
    c.num_train_steps = 1000
    c.optimizer = "adam"
    c.learning_rate = 1e-3
    c.schedule = "constant"
    c.warmup_steps = 0
    c.weight_decay = 0.0
    c.momentum = 0.9
    # Past float32 master weights. optimizer_state: float32 | bfloat16 (stochastically rounded)
    # | int8 (block-wise 8-bit, 256 values per scale; small arrays stay float32): what the
    # optimizer's moments are stored in (jamp.lowbit). param_rounding: how params stored in
    # bfloat16 (a policy's ",params=bf16", e.g. "mixed_bfloat16,params=bf16") take their float32
    # update: auto (stochastic; the program refuses float16 params) | stochastic (unbiased) | nearest
    # (stalls updates under half a bfloat16 ulp) | kahan (to nearest, with a compensation buffer
    # of 2 bytes per param carrying what was lost).
    c.optimizer_state = "float32"
    c.param_rounding = "auto"
    c.max_grad_norm = 0.0  # 0: no clipping
    c.accumulation_steps = 1

    c.log_every_steps = 50
    c.eval_every_steps = 250
    c.checkpoint_every_steps = 500
    c.max_checkpoints_to_keep = 3
    c.seed = 0
    return _variant(c, variant)


def _variant(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    if variant in ("", None):
        return c
    if variant != "smoke":
        raise ValueError(f"unknown config variant {variant!r}; accepted: '' or 'smoke'")
    c.num_train_steps = 12
    c.log_every_steps = 4
    c.eval_every_steps = 6
    c.checkpoint_every_steps = 6
    return c
