"""The ONNX models ONNX Runtime runs on qkv's workloads, written with Debian's python3-onnx
(apt-get install python3-onnx) for bench/peers/ort_attention.js; run.py calls write_models.

Per workload, every form ONNX Runtime offers for it on the CPU (the driver keeps the fastest):
  no mask    com.microsoft MultiHeadAttention, q/k/v as (B, N, H*d): its MLAS flash kernel
  causal     com.microsoft GroupQueryAttention (always causal; num_heads = kv_num_heads when
             not grouped) and, when Hq = Hkv, MultiHeadAttention with unidirectional = 1
  grouped    GroupQueryAttention (W3)
  module     W5: a plain subgraph, x W_in + b_in, the heads (Reshape, Transpose), MatMul,
             Softmax, MatMul, the output projection
Float32 only: ONNX Runtime's CPU kernels of these ops take no 16-bit K/V.
Each model's entry in the manifest names its graph inputs (random floats, or given int32 values)
and, for attention, the shape ort_attention.js checks a few output rows against.
"""
import math
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "qkv_peer", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=OPSETS, producer_name="qkv bench/peers")
    model.ir_version = 8
    return model


def _float_input(name, dims):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _attention_models(w):
    """(variant, model, inputs) for an attention workload w (a dict of run.py's table)."""
    b, hq, hkv, nq, nk, d = w["batch"], w["q_heads"], w["kv_heads"], w["q_len"], w["kv_len"], w["head_dim"]
    qkv_inputs = [_float_input("query", [b, nq, hq * d]), _float_input("key", [b, nk, hkv * d]),
                  _float_input("value", [b, nk, hkv * d])]
    feeds = [{"name": "query", "dims": [b, nq, hq * d]}, {"name": "key", "dims": [b, nk, hkv * d]},
             {"name": "value", "dims": [b, nk, hkv * d]}]
    out = [_float_input("output", [b, nq, hq * d])]
    models = []
    if hq == hkv and (not w["causal"] or nq == nk):
        attrs = {"num_heads": hq}
        if w["causal"]:
            attrs["unidirectional"] = 1
        node = helper.make_node("MultiHeadAttention", ["query", "key", "value"], ["output"],
                                domain="com.microsoft", **attrs)
        name = "MultiHeadAttention" + (" unidirectional" if w["causal"] else "")
        models.append((name, _model([node], qkv_inputs, out), feeds))
    if w["causal"]:
        # Prompt without a past: seqlens_k = total - 1 per batch entry, total = Nk (= Nq).
        node = helper.make_node(
            "GroupQueryAttention",
            ["query", "key", "value", "", "", "seqlens_k", "total_sequence_length"],
            ["output", "present_key", "present_value"],
            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv)
        inputs = qkv_inputs + [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
                               helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1])]
        outputs = out + [_float_input("present_key", None), _float_input("present_value", None)]
        gqa_feeds = feeds + [{"name": "seqlens_k", "dims": [b], "int32": [nk - 1] * b},
                             {"name": "total_sequence_length", "dims": [1], "int32": [nk]}]
        models.append(("GroupQueryAttention", _model([node], inputs, outputs), gqa_feeds))
    return models


def _module_model(w):
    """W5: nn.MultiheadAttention's forward as plain ONNX ops (no mask, no dropout)."""
    b, n, h, d = w["batch"], w["q_len"], w["q_heads"], w["head_dim"]
    e = h * d
    rng = np.random.default_rng(42)
    bound = 1.0 / math.sqrt(e)
    weights = {
        "w_in": rng.uniform(-bound, bound, (e, 3 * e)).astype(np.float32),
        "b_in": np.zeros(3 * e, np.float32),
        "w_out": rng.uniform(-bound, bound, (e, e)).astype(np.float32),
        "b_out": np.zeros(e, np.float32),
        "heads_shape": np.array([b, n, 3, h, d], np.int64),
        "merged_shape": np.array([b, n, e], np.int64),
        "scale": np.array(1.0 / math.sqrt(d), np.float32),
    }
    initializers = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["xw"]),
        helper.make_node("Add", ["xw", "b_in"], ["qkv"]),
        helper.make_node("Reshape", ["qkv", "heads_shape"], ["qkv5"]),             # (B, N, 3, H, d)
        helper.make_node("Transpose", ["qkv5"], ["qkvt"], perm=[2, 0, 3, 1, 4]),   # (3, B, H, N, d)
        helper.make_node("Split", ["qkvt"], ["q1", "k1", "v1"], axis=0),
        helper.make_node("Squeeze", ["q1", "axis0"], ["q"]),
        helper.make_node("Squeeze", ["k1", "axis0"], ["k"]),
        helper.make_node("Squeeze", ["v1", "axis0"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),                             # (B, H, N, d)
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ot", "merged_shape"], ["om"]),
        helper.make_node("MatMul", ["om", "w_out"], ["ow"]),
        helper.make_node("Add", ["ow", "b_out"], ["y"]),
    ]
    initializers.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    model = _model(nodes, [_float_input("x", [b, n, e])], [_float_input("y", [b, n, e])], initializers)
    return [("MatMul-Softmax-MatMul subgraph", model, [{"name": "x", "dims": [b, n, e]}])]


def write_models(workloads, folder):
    """Writes the models of the float32 workloads into folder; returns the manifest (a list)."""
    os.makedirs(folder, exist_ok=True)
    manifest = []
    for w in workloads:
        if w["kv_dtype"] != "f32":
            continue
        models = _module_model(w) if w["kind"] == "module" else _attention_models(w)
        for index, (variant, model, feeds) in enumerate(models):
            path = os.path.join(folder, f"{w['id']}-{index}.onnx")
            onnx.save(model, path)
            entry = {"workload": w["id"], "variant": variant, "path": path, "feeds": feeds}
            if w["kind"] != "module":
                entry["check"] = {k: w[k] for k in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim",
                                                    "causal")}
            manifest.append(entry)
    return manifest
