"""Other libraries' attention kernels behind this library's contract: tokamax's implementations and
ColabFold's fused kernels (colabfold-kernels), where those packages are installed.

Each is an Implementation like ours: it takes the op's validated inputs, refuses in `check` (with
the reason) what it cannot take, and meets numerics.py's contract as cudnn.py's adapter does:
masked inputs zeroed first (numerics.zero_dead_inputs), so they never leak, and rows with no key to
attend to set to the uniform average of the values (numerics.finish_rows_without_key). Neither
package is imported until a plan or a call asks for it: importing gated_attention imports neither.

'auto' never takes one by its rules (dispatch.Auto): only the GPU's tuning table may name one,
where a sweep (gated_attention_tools/sweep.py) timed it correct and fastest (per_mode.measured).

* TokamaxAttention(implementation=...): tokamax.dot_product_attention with one of tokamax's
  implementations ('mosaic', 'triton', 'cudnn' on a GPU; 'xla', 'xla_chunked' anywhere). tokamax
  takes the public layout, grouped-query attention, a value head dim of its own, every bias and
  mask shape, the causal, window and length masks, a soft cap and a precision; not the residual.
* ColabFoldAttention(packed=...): colabfold_kernels.fused_ops' Triton kernel as its AF2 calls it
  (fused_ops.attention, q, k, v [B, T, N, H] as they lie) or its packed one (fused_ops.
  packed_attention, one [B, T, 3, N, H] array read in place). Half precision on a GPU of compute
  capability 8.0 or later; one bias shared over the batch ([1, N|1, T|1, S|1], ColabFold's
  nonbatched bias) and a key mask ([B|1, 1, 1, S|1]) only; equal head dims and as many key as
  query heads; the packed one self-attention (T == S). path='xla' runs the same adaptation through
  ColabFold's own XLA reference of the kernel (tri_flash.ref_attn) on any backend: how it is
  tested without a GPU (its kernels use PTX inline assembly, which Pallas cannot interpret).
"""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp

from gated_attention.attention import base
from gated_attention.core import checks, compat, numerics, platforms

HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def import_peer(module: str, package: str, what: str):
    """The module, or NotImplementedError saying the package is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NotImplementedError(f"{what}: {package} is not installed ({e})") from None


def _on_gpu(what: str, platform) -> None:
    platform = platforms.host() if platform is None else platforms.kind(platform)
    if platform != "gpu":
        raise NotImplementedError(f"{what} runs on GPU only, the program is for {platform!r}")


def _no_offset(what: str, options) -> None:
    # A query offset (ring attention's key shards) shifts the causal and window masks: no peer has it.
    if options.structure.q_offset is not None:
        raise NotImplementedError(f"{what} takes no query offset (ring attention's key shards)")


def _summed(biases, dtype):
    """One bias (as given), their sum in `dtype` where there are several, or None."""
    if not biases:
        return None
    if len(biases) == 1:
        return biases[0]
    total = biases[0].astype(dtype)
    for b in biases[1:]:
        total = total + b.astype(dtype)
    return total


# ------------------------------------------------------------------------------------------------
# tokamax
# ------------------------------------------------------------------------------------------------

TOKAMAX_IMPLEMENTATIONS = ("mosaic", "triton", "cudnn", "xla_chunked", "xla")  # tokamax's names
TOKAMAX_ON_GPU = ("mosaic", "triton", "cudnn")
TOKAMAX_DTYPES = (jnp.dtype(jnp.float32), *HALF)  # its Pallas kernels' (cuDNN: half only)
CUDNN_MAX_HEAD_DIM = 128  # as cudnn.py: what holds on every GPU cuDNN flash attention runs on


@dataclasses.dataclass(frozen=True)
class TokamaxAttention(base.Implementation):
    """tokamax.dot_product_attention with one of its implementations, adapted to this contract.

    Attributes:
      implementation: tokamax's implementation, as tokamax names it: 'mosaic' (Mosaic GPU: its
        forward on sm_80 to sm_10x, its backward on sm_90 and sm_10x only), 'triton' (Pallas
        Triton, compute capability 8.0 or later), 'cudnn' (jax.nn's cuDNN), 'xla_chunked' or
        'xla' (any backend).
    """

    implementation: str = "xla"

    TAKES = frozenset(
        (
            "grouped",
            "is_causal",
            "local_window_size",
            "query_seq_lengths",
            "key_value_seq_lengths",
            "logits_soft_cap",
            "precision",
        )
    )

    def __post_init__(self):
        checks.check_one_of("implementation", self.implementation, TOKAMAX_IMPLEMENTATIONS)

    @property
    def name(self) -> str:  # its IMPLEMENTATIONS key, as the device benchmark's variants
        return f"tokamax_{self.implementation}"

    def candidates(self, capability, dtype, head_dim: int, *, bias="shared", mask="key"):
        """The instance as it is where this implementation runs on a GPU of `capability` at
        `dtype` and `head_dim` (check()'s static rules); else none. (An instance's method: the
        implementation is a field.)"""
        del bias, mask
        dtype = jnp.dtype(dtype)
        if dtype not in TOKAMAX_DTYPES:
            return []
        if self.implementation in ("mosaic", "triton") and capability < (8, 0):
            return []  # tokamax's Pallas kernels want sm_80 or later
        if self.implementation == "cudnn":
            takes = dtype in HALF and head_dim % 8 == 0 and head_dim <= CUDNN_MAX_HEAD_DIM
            return [{}] if takes else []
        if self.implementation == "mosaic" and capability >= (11, 0):
            return []
        return [{}]

    def check(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        what = f"tokamax's {self.implementation!r} attention"
        self.refuse_options(query, key, options)
        _no_offset(what, options)
        if options.residual_gradient or options.return_residual:  # refuse_options says so too
            raise NotImplementedError(f"{what} returns no residual")
        dtype = jnp.dtype(compute_dtype)
        if dtype not in TOKAMAX_DTYPES:
            names = ", ".join(d.name for d in TOKAMAX_DTYPES)
            raise NotImplementedError(f"{what} computes in {names}, got {dtype}")
        if self.implementation in TOKAMAX_ON_GPU:
            _on_gpu(what, platform)
            self._check_gpu(what, query, value, biases, dtype)
        import_peer("tokamax", "tokamax", what)
        self._tokamax_implementation()  # one it has

    def _check_gpu(self, what, query, value, biases, dtype) -> None:
        capability = platforms.gpu_capability()
        if capability is not None and capability < (8, 0):
            raise NotImplementedError(
                f"{what} needs compute capability 8.0 or later, got {capability[0]}.{capability[1]}"
            )
        if self.implementation == "mosaic" and capability is not None and capability >= (11, 0):
            raise NotImplementedError(
                f"{what} has kernels for sm_80 to sm_10x, got {capability[0]}.{capability[1]}"
            )
        if self.implementation != "cudnn":
            return
        head_dim = query.shape[-1]
        if dtype not in HALF:
            raise NotImplementedError(f"{what} takes float16 or bfloat16, got {dtype}")
        if value.shape[-1] != head_dim:
            raise NotImplementedError(
                f"{what} needs equal key and value head dims, got {head_dim} and {value.shape[-1]}"
            )
        if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
            raise NotImplementedError(
                f"{what} needs a head dim that is a multiple of 8 and <= {CUDNN_MAX_HEAD_DIM}, "
                f"got {head_dim}"
            )
        if compat.cudnn_version() is None:
            raise NotImplementedError(f"{what} needs the cuDNN library, which JAX cannot load here")

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
        del plan  # nothing planned
        tokamax = import_peer("tokamax", "tokamax", f"tokamax's {self.implementation!r} attention")
        q, k, v = (x.astype(compute_dtype) for x in (query, key, value))
        structure = options.structure
        live_q, live_k = structure.live(mask, query.shape[1], key.shape[1])
        out = tokamax.dot_product_attention(
            *numerics.zero_dead_inputs(q, k, v, live_q, live_k, head_major=False),
            _summed(biases, jnp.float32),
            mask,
            scale=scale,
            is_causal=structure.is_causal,
            query_seq_lengths=structure.q_lengths,
            key_value_seq_lengths=structure.kv_lengths,
            local_window_size=structure.window,
            logits_soft_cap=options.logits_soft_cap,
            precision=options.precision,
            implementation=self._tokamax_implementation(),
        )  # [B, T, N, Hv]
        return numerics.finish_rows_without_key(out.astype(query.dtype), None, v, live_q, False)

    def _tokamax_implementation(self):
        """tokamax's name, but its Mosaic GPU op itself for 'mosaic': tokamax resolves that name
        by the default device (a CPU host's compile for a GPU would get its TPU kernel). Its
        registry's (tokamax.ops.gpu would import jax_triton, which tokamax does not need)."""
        if self.implementation != "mosaic":
            return self.implementation
        what = "tokamax's 'mosaic' attention"
        api = import_peer("tokamax._src.ops.attention.api", "tokamax", what)
        if "mosaic_gpu" not in api.IMPLEMENTATIONS:
            raise NotImplementedError(f"{what}: this tokamax has no Mosaic GPU attention")
        return (api.IMPLEMENTATIONS["mosaic_gpu"],)  # a sequence: tokamax takes an op in one


# ------------------------------------------------------------------------------------------------
# ColabFold (colabfold-kernels)
# ------------------------------------------------------------------------------------------------

COLABFOLD_PATHS = ("pallas", "xla")
MASKED = -1e9  # ColabFold's additive mask (its kernel reads a key as masked below -1e3)


@dataclasses.dataclass(frozen=True)
class ColabFoldAttention(base.Implementation):
    """ColabFold's fused attention kernel (colabfold-kernels), adapted to this contract.

    Attributes:
      packed: its packed kernel (fused_ops.packed_attention: q, k, v one [B, T, 3, N, H] array,
        read in place from packed_dot_product_attention; dot_product_attention's are stacked
        into one) instead of fused_ops.attention.
      path: 'pallas', its kernel (a GPU); 'xla', ColabFold's XLA reference of it (tri_flash.
        ref_attn) on any backend, for tests of the adaptation.
    """

    packed: bool = False
    path: str = "pallas"

    def __post_init__(self):
        checks.check_bool("packed", self.packed)
        checks.check_one_of("path", self.path, COLABFOLD_PATHS)

    @property
    def name(self) -> str:  # its IMPLEMENTATIONS key
        return "colabfold_packed" if self.packed else "colabfold"

    @property
    def TAKES(self) -> frozenset:  # noqa: N802 (base.Implementation's attribute)
        return frozenset(("packed",)) if self.packed else frozenset()

    def candidates(self, capability, dtype, head_dim: int, *, bias="shared", mask="key"):
        """The instance as it is on a GPU of compute capability 8.0 or later in half precision
        at a shared bias (or none) and a key mask (or none); else none."""
        del head_dim
        takes = (
            jnp.dtype(dtype) in HALF
            and capability >= (8, 0)
            and bias in ("shared", "none")
            and mask in ("key", "none")
        )
        return [{}] if takes else []

    def check(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        what = "ColabFold's packed attention kernel" if self.packed else "ColabFold's kernel"
        self.refuse_options(query, key, options)
        _no_offset(what, options)
        q, k, v = base.unpacked_shapes(query, key, value, options)
        if v.shape[-1] != q.shape[-1]:
            raise NotImplementedError(
                f"{what} needs equal key and value head dims, got {q.shape[-1]} and {v.shape[-1]}"
            )
        if self.packed and q.shape[1] != k.shape[1]:
            raise NotImplementedError(
                f"{what} is self-attention (T == S), got T={q.shape[1]}, S={k.shape[1]}"
            )
        if any(b.shape[0] != 1 for b in biases):
            shapes = [tuple(b.shape) for b in biases]
            raise NotImplementedError(
                f"{what} takes a bias shared over the batch ([1, N|1, T|1, S|1]), got {shapes}"
            )
        if mask is not None and mask.shape[1:3] != (1, 1):
            raise NotImplementedError(
                f"{what} takes a key mask [B|1, 1, 1, S|1] only, got {tuple(mask.shape)}"
            )
        dtype = jnp.dtype(compute_dtype)
        if self.path == "xla":
            import_peer("colabfold_kernels.tri_flash", "colabfold-kernels", what)
            return
        _on_gpu(what, platform)
        if dtype not in HALF:
            raise NotImplementedError(f"{what} takes float16 or bfloat16, got {dtype}")
        capability = platforms.gpu_capability()
        if capability is not None and capability < (8, 0):
            raise NotImplementedError(
                f"{what} (Triton) needs compute capability 8.0 or later, got "
                f"{capability[0]}.{capability[1]}"
            )
        if self._kernel(what, dtype, q.shape[-1]) is None:
            raise NotImplementedError(f"{what}: colabfold-kernels has none for {dtype} here")

    def _kernel(self, what, dtype, head_dim):
        """fused_ops' kernel as ColabFold's AF2 asks for it (its config from device.dispatch)."""
        fused_ops = import_peer("colabfold_kernels.fused_ops", "colabfold-kernels", what)
        device = import_peer("colabfold_kernels.device", "colabfold-kernels", what)
        config = device.dispatch("auto")
        if self.packed:
            return fused_ops.packed_attention(config, dtype, head_dim, head_dim)
        return fused_ops.attention(config, dtype, head_dim, head_dim, layout="seq")

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
        del plan  # nothing planned
        dtype = jnp.dtype(compute_dtype)
        if options.packed:  # [B, T, P, N, H]: slots 0, 1, 2 (a further slot is the caller's)
            qkv = query if query.shape[2] == 3 else query[:, :, :3]
            q_shape, k_shape = base.slot_shape(qkv), base.slot_shape(qkv)
        else:
            qkv, q_shape, k_shape = None, query, key
        batch, q_len, heads, _ = q_shape.shape
        kv_len = k_shape.shape[1]
        live_q, live_k = options.structure.live(mask, q_len, kv_len)
        bias = _summed(biases, jnp.float32)  # ColabFold's nonbatched bias [N, T, S]
        bias = None if bias is None else jnp.broadcast_to(bias[0], (heads, q_len, kv_len))
        keep = jnp.ones((1, kv_len), bool) if mask is None else mask[:, 0, 0, :]
        keep = jnp.broadcast_to(keep, (keep.shape[0], kv_len))  # [B|1, S]
        if qkv is not None:
            out = self._packed(qkv.astype(dtype), bias, keep, live_q, live_k, scale, batch)
            values = qkv[:, :, 2]
        else:
            q, k, v = (x.astype(dtype) for x in (query, key, value))
            q, k, v = numerics.zero_dead_inputs(q, k, v, live_q, live_k, head_major=False)
            values = value.astype(dtype)
            if self.packed:  # dot_product_attention's q, k, v: the kernel reads one array
                out = self._packed(
                    jnp.stack([q, k, v], axis=2), bias, keep, None, None, scale, batch
                )
            else:
                out = self._unpacked(q, k, v, bias, keep, scale)
        out = out.astype(query.dtype)
        return numerics.finish_rows_without_key(out, None, values, live_q, False)

    def _unpacked(self, q, k, v, bias, keep, scale):
        """fused_ops.attention's kernel on q, k, v [B, T, N, H] as they lie (or the reference)."""
        mask_bias = jnp.where(keep, 0.0, MASKED).astype(q.dtype)[:, None, None, :]  # [B|1,1,1,S]
        if self.path == "xla":
            return self._reference(q, k, v, bias, keep, scale)
        kernel = self._kernel("ColabFold's kernel", q.dtype, q.shape[-1])
        return kernel(q, k, v, mask_bias, bias, scale)

    def _packed(self, qkv, bias, keep, live_q, live_k, scale, batch):
        """fused_ops.packed_attention's kernel on qkv [B, T, 3, N, H] (or the reference): masked
        inputs zeroed in the packed array (live_q, live_k: those of packed inputs)."""
        if live_q is not None or live_k is not None:
            q, k, v = numerics.zero_dead_inputs(
                *base.unpacked(qkv), live_q, live_k, head_major=False
            )
            qkv = jnp.stack([q, k, v], axis=2)  # a copy only where some input is dead
        keep = jnp.broadcast_to(keep, (batch, keep.shape[1]))  # its kmask: [B, S]
        if self.path == "xla":
            return self._reference(*base.unpacked(qkv), bias, keep, scale)
        kernel = self._kernel("ColabFold's packed attention kernel", qkv.dtype, qkv.shape[-1])
        return kernel(qkv, bias, keep, None, sm_scale=scale)

    @staticmethod
    def _reference(q, k, v, bias, keep, scale):
        """ColabFold's XLA reference of its kernel (tri_flash.ref_attn: heads-major [B, N, S, H],
        the bias [N, T, S], the key mask [B, S]) in the public layout."""
        from colabfold_kernels import tri_flash

        heads = lambda x: jnp.swapaxes(x, 1, 2)
        batch, q_len, n, _ = q.shape
        bias = jnp.zeros((n, q_len, k.shape[1]), q.dtype) if bias is None else bias.astype(q.dtype)
        keep = jnp.broadcast_to(keep, (batch, keep.shape[1]))
        return heads(tri_flash.ref_attn(heads(q), heads(k), heads(v), bias, keep, scale))


PEER_TYPES = (TokamaxAttention, ColabFoldAttention)  # other libraries' kernels, as dispatch lists
