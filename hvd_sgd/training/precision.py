"""``--precision``: float32, or Keras' mixed precision, with every rank agreeing on every step.

- mixed_bfloat16: layers compute in bfloat16 (the range of float32, 8 bits of mantissa) and keep
  float32 weights; no loss scaling. Fast where the CPU has AVX-512 BF16 or AMX, and on every GPU
  since Ampere.
- mixed_float16: float16 compute, for older GPUs, with dynamic loss scaling. Averaged before the
  scale's check, a gradient that overflows on one rank overflows the average on every rank: all
  skip that step and halve the scale together, and the scale is the same on every rank at every
  step (broadcast at the start, checkpointed, compared at the end with the weights).

In each, the model's logits, the loss and the exported model are float32 (docs/design.md, "Mixed
precision"). On a CPU, a 16-bit type is fast only where the CPU computes in it (``check``).
"""
import tensorflow as tf

from hvd_sgd import JobError
from hvd_sgd.training import distributed

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
# The CPU flags (/proc/cpuinfo) of arithmetic in each 16-bit type; without them TensorFlow converts.
NATIVE = {"mixed_float16": ("avx512_fp16", "amx_fp16"), "mixed_bfloat16": ("avx512_bf16", "amx_bf16")}
# What was measured, quoted by check's lines (docs/design.md, "Mixed precision").
EMULATED = {"mixed_float16": "65x slower than float32 (the default CNN on 2 ranks of a Zen 4)",
            "mixed_bfloat16": "10x slower than float32 (the default CNN on 2 ranks of a Zen 3)"}
BFLOAT16_NATIVE = "1.28x as fast as float32 on Zen 4, 1.32x on Intel with AMX (the default CNN on 2 ranks)"


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags."""
    with open(cpuinfo) as f:
        return set(next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "").split())


def check(numerics, device, flags, log):
    """No precision trap on a CPU: a 16-bit precision where the CPU has no arithmetic in that type
    is a JobError (unless --force-precision), and float32 where it computes bfloat16 natively gets
    one hint line (``log``). ``numerics``: the configuration's section; ``device``: the rank's (a
    GPU has both types)."""
    if device != "CPU":
        return
    has = {precision: sorted(flags & set(names)) for precision, names in NATIVE.items()}
    chosen = numerics.precision
    if chosen in NATIVE and not has[chosen] and not numerics.force_precision:
        instead = (f"--precision mixed_bfloat16 (this CPU has {', '.join(has['mixed_bfloat16'])})"
                   if chosen == "mixed_float16" and has["mixed_bfloat16"] else "float32")
        raise JobError(f"--precision {chosen}: this CPU has no {chosen.removeprefix('mixed_')} arithmetic (no "
                       f"{' or '.join(NATIVE[chosen])}), so it trains {EMULATED[chosen]}: use "
                       f"{instead}, or add --force-precision")
    if chosen == "float32" and has["mixed_bfloat16"]:
        log(f"hint: this CPU computes bfloat16 ({', '.join(has['mixed_bfloat16'])}): --precision mixed_bfloat16 "
            f"trained {BFLOAT16_NATIVE}, with 2 ranks equal to 1 to bfloat16's rounding")


def use(precision):
    """The policy of the layers built from now on (Keras' global policy)."""
    tf.keras.mixed_precision.set_global_policy(precision)


def with_float32_logits(model, input_shape):
    """``model``, its logits cast to float32 if its layers compute in another type: the loss, the
    evaluation and a caller's predictions see float32. A Sequential or functional model gains one
    layer at its end; a subclassed one (no declared outputs) is wrapped, and built for images of
    ``input_shape``."""
    outputs = getattr(model, "outputs", None)  # a subclassed model has none (Keras 3: not even the attribute)
    if tf.keras.mixed_precision.global_policy().compute_dtype == "float32" or (
            outputs is not None and outputs[0].dtype == tf.float32):
        return model
    cast = tf.keras.layers.Activation("linear", dtype="float32", name="logits_float32")
    if getattr(model, "inputs", None):
        return tf.keras.Model(model.inputs, cast(model.outputs[0]), name=model.name)
    wrapped = tf.keras.Sequential([model, cast], name=model.name)
    wrapped.build((None, *input_shape))
    return wrapped


def loss_scaled(optimizer, precision):
    """``optimizer`` with dynamic loss scaling where float16 needs it."""
    if precision != "mixed_float16":
        return optimizer
    return tf.keras.mixed_precision.LossScaleOptimizer(optimizer)


def loss_scale_variables(optimizer):
    """The loss scale's state (the scale, and the steps since it last changed) where Keras keeps it
    outside the optimizer's variables (Keras 2); [] otherwise. Keras 3 lists them among its variables."""
    state = getattr(optimizer, "_loss_scale", None)
    if distributed.KERAS_3 or state is None or not hasattr(state, "current_loss_scale"):
        return []
    return [state.current_loss_scale, state.counter]


def loss_scale(optimizer):
    """The current loss scale, or None without loss scaling."""
    if not isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer):
        return None
    return float(optimizer.dynamic_scale if distributed.KERAS_3 else optimizer.loss_scale)
