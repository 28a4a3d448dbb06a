"""One implementation for inference and another for the training step, chosen per mode.

A device run can time one kernel fastest for a forward alone and another for a forward with its
backward (tuning.py). PerMode runs `inference` where the call is not differentiated and
`training`'s forward and backward where it is: a custom VJP whose primal is the first and whose
forward rule is the second's (jax.vjp's function is a pytree of its residuals, so it is the
residual). Both must take the inputs; the outputs agree within the implementations' tolerances.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from gated_attention.attention import base, tuning
from gated_attention.core import platforms


@dataclasses.dataclass(frozen=True)
class PerMode(base.Implementation):
    """`inference` when the call is not differentiated, `training` when it is.

    Attributes:
      inference, training: the two implementations.
    """

    inference: base.Implementation
    training: base.Implementation

    # Positions-first and packed inputs reach each member as it takes them (base.run).
    TAKES = base.ALL_OPTIONS | {"positions_first", "packed"}

    @property
    def name(self) -> str:  # the record of what ran: both, by mode
        return f"{self.inference.name} (inference), {self.training.name} (training)"

    def plan(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=base.PLAIN,
        platform=None,
    ):
        """(inference's plan, training's plan): both must take the inputs."""
        return tuple(
            impl.plan(
                query,
                key,
                value,
                biases,
                mask,
                scale=scale,
                compute_dtype=compute_dtype,
                options=options,
                platform=platform,
            )  # fmt: skip
            for impl in (self.inference, self.training)
        )

    def __call__(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=base.PLAIN,
        plan=None,
    ):
        plans = (None, None) if plan is None else plan

        def call(which, q, k, v, b, mask, options):
            impl = (self.inference, self.training)[which]
            return base.run(
                impl, q, k, v, b, mask, scale=scale, compute_dtype=compute_dtype,
                options=options, plan=plans[which],
            )  # fmt: skip

        # mask and options (a pytree: the traced lengths) are arguments: a custom VJP must not
        # close over the caller's tracers.
        @jax.custom_vjp
        def attend(q, k, v, b, mask, options):
            return call(0, q, k, v, b, mask, options)

        def attend_fwd(q, k, v, b, mask, options):
            training = functools.partial(call, 1, mask=mask, options=options)
            return jax.vjp(training, q, k, v, b)

        def attend_bwd(vjp, cotangent):
            return (*vjp(cotangent), None, None)  # nothing flows to the mask or the lengths

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(query, key, value, tuple(biases), mask, options)


def measured(impls, query, key, value, biases, mask, *, scale, compute_dtype, options, platform):
    """(implementation, plan, reason) that the GPU's table (tuning.py) measured fastest among
    `impls` for these inputs, a PerMode where inference and training differ; None where the table
    has no entry or the winner does not take the inputs."""
    kind = platforms.gpu_kind()
    length = max(query.shape[1], key.shape[1])
    found = tuning.lookup(kind, jax.numpy.dtype(compute_dtype), query.shape[-1], length)
    by_name = {impl.name: impl for impl in impls}
    if found is None or not set(found.values()) <= set(by_name):
        return None
    inference, training = by_name[found["forward"]], by_name[found["training"]]
    impl = inference if inference is training else PerMode(inference, training)
    try:
        plan = impl.plan(
            query, key, value, biases, mask, scale=scale, compute_dtype=compute_dtype,
            options=options, platform=platform,
        )  # fmt: skip
    except NotImplementedError:
        return None
    return (
        impl,
        plan,
        (
            f"measured fastest on {kind}: {inference.name} for inference, {training.name} for "
            "training (tuning.json)"
        ),
    )
