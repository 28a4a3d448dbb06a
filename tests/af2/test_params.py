"""Tests for gated_attention.af2.params: AF2 .npz checkpoints <-> Haiku params."""

import io
import re
import zipfile

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gated_attention.af2.params import (
    ParamsDiff,
    cast_params,
    check_params,
    diff_params,
    load_af2_params,
    save_af2_params,
)

EVO = "alphafold/alphafold_iteration/evoformer/evoformer_iteration"
LAYERS, C_M, C_Z = 48, 256, 128  # AF2 model_1: 48 Evoformer blocks, MSA and pair channels.


def _rand(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype)


def _write_npz(path, flat):
    """Writes {key: array} member by member (as np.savez does), keeping one array in memory."""
    with zipfile.ZipFile(path, "w") as zf:
        for key, make in flat.items():
            with zf.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, make() if callable(make) else make)
    return path


def _attention_shapes(c_in, heads, c):
    return {
        "query_w": (c_in, heads, c),
        "key_w": (c_in, heads, c),
        "value_w": (c_in, heads, c),
        "gating_w": (c_in, heads, c),
        "gating_b": (heads, c),
        "output_w": (heads, c, c_in),
        "output_b": (c_in,),
    }


def _af2_evoformer_shapes():
    """AF2 model_1's per-layer shapes for the four attention modules of an Evoformer block."""
    norm = {"scale": (C_M,), "offset": (C_M,)}
    pair_norm = {"scale": (C_Z,), "offset": (C_Z,)}
    shapes = {
        "msa_row_attention_with_pair_bias": {"feat_2d_weights": (C_Z, 8)},
        "msa_row_attention_with_pair_bias/attention": _attention_shapes(C_M, 8, 32),
        "msa_row_attention_with_pair_bias/query_norm": norm,
        "msa_row_attention_with_pair_bias/feat_2d_norm": pair_norm,
        "msa_column_attention/attention": _attention_shapes(C_M, 8, 32),
        "msa_column_attention/query_norm": norm,
    }
    for name in ("triangle_attention_starting_node", "triangle_attention_ending_node"):
        shapes[name] = {"feat_2d_weights": (C_Z, 4)}
        shapes[f"{name}/attention"] = _attention_shapes(C_Z, 4, 32)
        shapes[f"{name}/query_norm"] = pair_norm
    return shapes


@pytest.fixture(scope="module")
def af2_file(tmp_path_factory):
    """A synthetic params_model_1.npz: exact Evoformer attention keys/shapes plus two other keys."""
    flat = {}
    for i, (scope, params) in enumerate(sorted(_af2_evoformer_shapes().items())):
        for j, (name, shape) in enumerate(sorted(params.items())):
            flat[f"{EVO}/{scope}//{name}"] = lambda s=(LAYERS, *shape), seed=100 * i + j: _rand(
                s, seed
            )
    flat["alphafold/alphafold_iteration/evoformer/preprocess_1d//weights"] = _rand((22, 4))
    flat[
        "alphafold/alphafold_iteration/evoformer/extra_msa_stack/msa_column_global_attention/"
        "attention//key_w"
    ] = _rand((4, 8, 8))
    return _write_npz(tmp_path_factory.mktemp("af2") / "params_model_1.npz", flat)


def test_af2_exact_shapes_prefix_and_layer_7(af2_file):
    params = load_af2_params(af2_file, prefix=EVO, layer=7)

    shapes = jax.tree.map(np.shape, params)
    assert shapes == _af2_evoformer_shapes()
    assert shapes["msa_row_attention_with_pair_bias/attention"]["query_w"] == (256, 8, 32)
    assert shapes["triangle_attention_ending_node"]["feat_2d_weights"] == (128, 4)
    with np.load(af2_file) as reference:  # NumPy's own reader, whole arrays, then [7].
        for scope, named in params.items():
            for name, arr in named.items():
                expected = reference[f"{EVO}/{scope}//{name}"][7]
                assert arr.dtype == np.float32
                np.testing.assert_array_equal(arr, expected)
                assert not np.array_equal(arr, reference[f"{EVO}/{scope}//{name}"][6])


def test_af2_module_scope_as_prefix_puts_own_params_under_tilde(af2_file):
    params = load_af2_params(af2_file, prefix=f"{EVO}/triangle_attention_starting_node", layer=0)

    assert sorted(params) == ["attention", "query_norm", "~"]
    assert params["~"]["feat_2d_weights"].shape == (128, 4)
    with np.load(af2_file) as reference:
        np.testing.assert_array_equal(
            params["attention"]["output_w"],
            reference[f"{EVO}/triangle_attention_starting_node/attention//output_w"][0],
        )


def test_round_trip_stacked_without_prefix(tmp_path):
    params = {
        "block/attention": {"query_w": _rand((3, 4, 2, 5)), "output_b": _rand((3, 4), 1)},
        "block": {"steps": np.arange(3, dtype=np.int32)},
    }
    path = tmp_path / "ckpt"  # No '.npz': written exactly there.
    save_af2_params(params, path)

    assert path.exists()
    loaded = load_af2_params(path)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    assert loaded["block"]["steps"].dtype == np.int32


def test_round_trip_with_prefix_and_layer(tmp_path):
    stacked = {
        "attention": {"query_w": _rand((3, 4, 2, 5)), "output_b": _rand((3, 4), 1)},
        "~": {"feat_2d_weights": _rand((3, 6, 2), 2)},
    }
    path = tmp_path / "params.npz"
    save_af2_params(stacked, path, prefix=f"{EVO}/triangle_attention_starting_node")

    with np.load(path) as raw:
        assert sorted(raw.files) == sorted(
            [
                f"{EVO}/triangle_attention_starting_node//feat_2d_weights",
                f"{EVO}/triangle_attention_starting_node/attention//output_b",
                f"{EVO}/triangle_attention_starting_node/attention//query_w",
            ]
        )
    jax.tree.map(
        np.testing.assert_array_equal,
        load_af2_params(path, prefix=f"{EVO}/triangle_attention_starting_node"),
        stacked,
    )
    for layer in range(3):
        loaded = load_af2_params(path, prefix=EVO, layer=layer)
        expected = {
            f"triangle_attention_starting_node/{s}".replace("/~", ""): jax.tree.map(
                lambda x, i=layer: x[i], named
            )
            for s, named in stacked.items()
        }
        jax.tree.map(np.testing.assert_array_equal, loaded, expected)
        assert loaded["triangle_attention_starting_node/attention"]["query_w"].flags.owndata


def test_prefix_matches_whole_components(tmp_path):
    path = save_flat(
        tmp_path, {"a/b/c//w": np.ones(2), "a/b//v": np.zeros(3), "a/bc//u": np.ones(1)}
    )

    for prefix in ("a/b", "a/b/", "/a/b"):
        loaded = load_af2_params(path, prefix=prefix)
        assert jax.tree.map(np.shape, loaded) == {"c": {"w": (2,)}, "~": {"v": (3,)}}
    assert jax.tree.map(np.shape, load_af2_params(path, prefix="a/bc")) == {"~": {"u": (1,)}}


def test_reads_file_objects_compressed_and_fortran_order(tmp_path):
    arr = np.asfortranarray(_rand((4, 3, 2)))
    path = tmp_path / "c.npz"
    np.savez_compressed(path, **{"m/attention//w": arr, "m//b": _rand((4, 5), 3)})

    with open(path, "rb") as f:
        loaded = load_af2_params(f, prefix="m", layer=2)
        assert not f.closed  # The caller's file stays open.
    np.testing.assert_array_equal(loaded["attention"]["w"], arr[2])
    buffer = io.BytesIO(path.read_bytes())
    np.testing.assert_array_equal(load_af2_params(buffer)["m"]["b"], _rand((4, 5), 3))


def save_flat(tmp_path, flat, name="flat.npz"):
    path = tmp_path / name
    np.savez(path, **flat)
    return path


# ---------------------------------------------------------------------------- load errors


def test_missing_file(tmp_path):
    path = tmp_path / "params_model_9.npz"
    with pytest.raises(
        FileNotFoundError,
        match=r"params_model_9\.npz' not found: expected an "
        r"\.npz",
    ):
        load_af2_params(path)


def test_text_file_is_not_npz(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match=r"notes\.txt' is not an \.npz \(zip\) archive"):
        load_af2_params(path)


def test_npy_file_is_not_npz(tmp_path):
    path = tmp_path / "one.npy"
    np.save(path, np.ones(3))
    with pytest.raises(
        ValueError,
        match=r"one\.npy' is a \.npy file \(a single array\); "
        r"expected an \.npz",
    ):
        load_af2_params(path)


def test_zip_member_that_is_not_npy(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="holds 'readme.txt', which is not a .npy array"):
        load_af2_params(path)


@pytest.mark.parametrize("key", ["a/b/w", "a//b//w", "//w", "a/b//"])
def test_key_without_single_separator(tmp_path, key):
    path = save_flat(tmp_path, {"ok//w": np.ones(1), key: np.ones(1)})
    with pytest.raises(
        ValueError,
        match=f"key {re.escape(repr(key))} in .* is not 'scope//name' with exactly one '//'",
    ):
        load_af2_params(path)


def test_object_array(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, **{"a//w": np.array([None, 1], dtype=object)})
    with pytest.raises(ValueError, match=r"'a//w.npy' in .* holds Python objects"):
        load_af2_params(path)


def test_prefix_matching_nothing_lists_nearby_scopes(af2_file):
    typo = "alphafold/alphafold_iteration/evoformer/evoformer_iteraton"
    with pytest.raises(
        ValueError,
        match=re.escape(f"prefix '{typo}' matches no key in") + ".*available under 'alphafold/"
        "alphafold_iteration/evoformer' scope prefixes: .*'alphafold/alphafold_iteration/"
        "evoformer/evoformer_iteration'.*extra_msa_stack.*preprocess_1d",
    ):
        load_af2_params(af2_file, prefix=typo)
    with pytest.raises(ValueError, match=r"available top-level scope prefixes: \['alphafold'\]"):
        load_af2_params(af2_file, prefix="openfold")


def test_more_than_ten_scopes_are_summarised(tmp_path):
    path = save_flat(tmp_path, {f"root/m{i:02d}//w": np.ones(1) for i in range(13)})
    with pytest.raises(ValueError, match=r"'root/m09'\] and 3 more"):
        load_af2_params(path, prefix="root/x")


@pytest.mark.parametrize("prefix", ["", "/", "a//b"])
def test_invalid_prefix(tmp_path, prefix):
    path = save_flat(tmp_path, {"a/b//w": np.ones(1)})
    with pytest.raises(
        ValueError, match=f"prefix must be a non-empty scope path.*got {re.escape(repr(prefix))}"
    ):
        load_af2_params(path, prefix=prefix)
    with pytest.raises(TypeError, match="prefix must be a str or None, got 3"):
        load_af2_params(path, prefix=3)


@pytest.mark.parametrize("layer", [4, -1])
def test_layer_out_of_range(tmp_path, layer):
    path = save_flat(tmp_path, {"s/a//w": np.ones((4, 2)), "s/b//w": np.ones((4,))})
    with pytest.raises(
        ValueError,
        match=f"layer={layer} is out of range: the arrays under "
        r"prefix 's' in .* stack 4 layers \(expected 0 <= layer < 4\)",
    ):
        load_af2_params(path, prefix="s", layer=layer)


def test_layer_for_unstacked_params(af2_file, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"layer=0 given, but the arrays under prefix "
        r"'alphafold/alphafold_iteration/evoformer' in .* do not share a stacked "
        r"leading axis \(leading dim 4: 1 arrays.*leading dim 22: 1 arrays, e.g. "
        r".*preprocess_1d//weights' \(22, 4\); leading dim 48: 41 arrays",
    ):
        load_af2_params(af2_file, prefix="alphafold/alphafold_iteration/evoformer", layer=0)
    path = save_flat(tmp_path, {"a//w": np.ones((3, 2)), "a//step": np.array(5)})
    with pytest.raises(
        ValueError,
        match=r"\(scalar: 1 arrays, e.g. 'a//step' \(\); leading dim "
        r"3: 1 arrays, e.g. 'a//w' \(3, 2\)\); pass layer=None",
    ):
        load_af2_params(path, layer=1)


@pytest.mark.parametrize("layer", [1.0, "7", True])
def test_layer_not_an_int(tmp_path, layer):
    path = save_flat(tmp_path, {"a//w": np.ones((3, 2))})
    with pytest.raises(
        TypeError, match=f"layer must be an int or None, got {re.escape(repr(layer))}"
    ):
        load_af2_params(path, layer=layer)
    np.testing.assert_array_equal(load_af2_params(path, layer=np.int64(2))["a"]["w"], np.ones(2))


# ---------------------------------------------------------------------------- save errors


def test_save_rejects_bfloat16_and_bad_names(tmp_path):
    path = tmp_path / "x.npz"
    with pytest.raises(
        ValueError,
        match=r"params\['a'\]\['w'\] has dtype bfloat16, which .npz "
        r"cannot store portably; cast it first",
    ):
        save_af2_params({"a": {"w": jnp.ones(2, jnp.bfloat16)}}, path)
    with pytest.raises(ValueError, match="params scope must be a non-empty str .* got 'a//b'"):
        save_af2_params({"a//b": {"w": np.ones(2)}}, path)
    with pytest.raises(ValueError, match=r"params\['a'\] has parameter name 'x/w'"):
        save_af2_params({"a": {"x/w": np.ones(2)}}, path)
    with pytest.raises(
        TypeError,
        match=r"params must be a two-level mapping .* got a leaf at "
        r"\['a'\]",
    ):
        save_af2_params({"a": np.ones(2)}, path)


def test_save_jax_arrays_and_cast(tmp_path):
    params = {
        "lin": {
            "w": jnp.arange(6.0, dtype=jnp.bfloat16).reshape(2, 3),
            "n": jnp.array([1, 2], jnp.int32),
        }
    }
    path = tmp_path / "x.npz"
    save_af2_params(cast_params(params, np.float32), path)

    loaded = load_af2_params(path)
    assert loaded["lin"]["w"].dtype == np.float32 and loaded["lin"]["n"].dtype == np.int32
    np.testing.assert_array_equal(loaded["lin"]["w"], np.arange(6.0).reshape(2, 3))


# ---------------------------------------------------------------------------- check/diff


def _module_shapes():
    """eval_shape params of a top-level module 'outer' holding a parameter and a Linear."""

    class Outer(hk.Module):
        def __call__(self, x):
            w = hk.get_parameter("feat_2d_weights", [3, 2], init=jnp.ones)
            return hk.Linear(2, name="attention")(x) @ w.T

    forward = hk.transform(lambda x: Outer(name="outer")(x))
    x = jnp.ones((1, 4))
    return forward, x, jax.eval_shape(forward.init, jax.random.key(0), x)


def test_loaded_params_drive_haiku_module(tmp_path):
    forward, x, shapes = _module_shapes()
    params = jax.tree.map(lambda s: _rand(s.shape, seed=s.size), shapes)
    stacked = jax.tree.map(lambda p: np.stack([p * 0, p, p * 2]), params)
    path = tmp_path / "m.npz"
    save_af2_params(stacked, path, prefix=EVO)

    loaded = load_af2_params(path, prefix=EVO, layer=1)
    check_params(loaded, shapes)
    apply = jax.jit(forward.apply)
    np.testing.assert_array_equal(apply(loaded, None, x), apply(params, None, x))


def test_diff_and_check_report_everything_at_once():
    _, _, shapes = _module_shapes()
    params = {
        "outer": {"feat_2d_weights": np.ones((3, 4))},
        "outer/attention": {"w": np.ones((4, 2)), "bias": np.ones(2)},
        "outer/query_norm": {"scale": np.ones(4)},
    }

    diff = diff_params(params, shapes)
    assert diff == ParamsDiff(
        missing=[("outer/attention//b", (2,))],
        unexpected=[("outer/attention//bias", (2,)), ("outer/query_norm//scale", (4,))],
        mis_shaped=[("outer//feat_2d_weights", (3, 4), (3, 2))],
    )
    assert not diff.ok
    with pytest.raises(
        ValueError,
        match=re.escape(
            "params differ from expected: 1 missing, 2 unexpected, 1 mis-shaped\n"
            "  missing     outer/attention//b (expected shape (2,))\n"
            "  unexpected  outer/attention//bias (shape (2,))\n"
            "  unexpected  outer/query_norm//scale (shape (4,))\n"
            "  mis-shaped  outer//feat_2d_weights: shape (3, 4), expected (3, 2)"
        ),
    ):
        check_params(params, shapes)


def test_diff_ok_for_matching_params():
    _, _, shapes = _module_shapes()
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    diff = diff_params(params, shapes)
    assert diff.ok and str(diff) == "params match expected"
    check_params(params, shapes)


def test_cast_params_casts_floats_only():
    params = {"a": {"w": np.full(2, 1.5, np.float32), "n": np.arange(2)}}
    cast = cast_params(params, jnp.bfloat16)
    assert cast["a"]["w"].dtype == jnp.bfloat16 and cast["a"]["n"].dtype == params["a"]["n"].dtype
    np.testing.assert_array_equal(cast["a"]["w"].astype(np.float32), [1.5, 1.5])
