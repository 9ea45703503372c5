"""``parallelize(repeated_blocks=...)`` (issue 20): capture traces two blocks of a ModuleList of
identical blocks and writes the others as copies (compile/repeated/).

The oracle is the trace of every block: the copied joint graph must equal it node for node (ops,
arguments, module stacks, source lines, autograd sequence order, parameter and gradient slots),
and a whole compile's dumps must be byte for byte the same. Where the blocks are not copies of each
other, the compile must notice, say why, and trace every block.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.compile.capture import capture
from hyper_parallel.compile.repeated import capture_blocks_once, check_option
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.testing.parity import build_model, global_batch


def _canonical(gm: fx.GraphModule) -> list[tuple]:
    """Every node with names as a fresh trace would number them (tracing leaves gaps where it
    dropped dead nodes, which differ between a 2-block and an N-block trace), its arguments, module
    stacks, source line and autograd sequence number relative to the graph's first."""
    namespace, names, rows = fx.graph._Namespace(), {}, []
    numbers = [n.meta["seq_nr"] for n in gm.graph.nodes if "seq_nr" in n.meta]
    first = min(numbers) if numbers else 0
    for node in gm.graph.nodes:
        if hasattr(node.target, "overloadpacket"):
            candidate = node.target.overloadpacket.__name__
        elif node.op in ("placeholder", "output"):
            candidate = node.name
        else:
            candidate = gm.graph._target_to_str(node.target)
        names[node] = namespace.create_name(candidate, None)
        args = fx.node.map_arg((node.args, node.kwargs), lambda x: names[x])
        rows.append((names[node], node.op, str(node.target), str(args), node.meta.get("nn_module_stack"),
                     node.meta.get("fwd_nn_module_stack"), node.meta.get("stack_trace"),
                     node.meta.get("seq_nr", first) - first, node.meta.get("partitioner_tag")))
    return rows


def _assert_same_capture(full, copied) -> None:
    assert copied.inputs == full.inputs
    assert copied.outputs == full.outputs
    rows_full, rows_copied = _canonical(full.gm), _canonical(copied.gm)
    assert len(rows_full) == len(rows_copied)
    for a, b in zip(rows_full, rows_copied):
        assert a == b, f"first difference at {a[0]}:\n{a}\n{b}"


def _four_layers(arch: str) -> dict:
    from hyper_parallel.models.hf_zoo import tiny_hf_config

    layer_types = getattr(tiny_hf_config(arch), "layer_types", None)
    overrides = {"num_hidden_layers": 4}
    if layer_types:  # the tiny config lists one type per layer
        overrides["layer_types"] = (list(layer_types) * 4)[:4]
    return overrides


# arch -> what capture must do with 4 layers: the list it copies, or why it traces every block.
ZOO = {
    "LlamaForCausalLM": "2 of 4 blocks of model.layers traced",
    "GPT2LMHeadModel": "2 of 4 blocks of transformer.h traced",
    "BertForMaskedLM": "2 of 4 blocks of bert.encoder.layer traced",
    "MixtralForCausalLM": "2 of 4 blocks of model.layers traced",
    # Sliding and full attention alternate: the blocks are not copies of block 1.
    "Gemma2ForCausalLM": "attribute 'self_attn.layer_type' differs between blocks",
}


def _captured(result) -> tuple:
    return result.full(), result.traced


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ZOO))
def test_transformers_models_copy_exactly_or_trace_every_block(arch, caplog):
    pytest.importorskip("transformers")
    model = build_model(f"hf:{arch}", **_four_layers(arch))
    batch = global_batch(arch, 2, 16, seed=1)
    full = capture(model, (), batch)
    with caplog.at_level(logging.INFO, logger="hyper_parallel.compile.repeated.capture"):
        copied, traced = _captured(capture_blocks_once(model, (), batch, {}, {}, "auto", lambda: None))
    if ZOO[arch].endswith("traced"):
        assert traced == ZOO[arch]
    else:
        assert traced == "" and ZOO[arch] in caplog.text, caplog.text
    _assert_same_capture(full, copied)


def _dump_plan(name: str) -> dict:
    from hyper_parallel.models.plans import llama_tp_plan

    if name == "fsdp_bf16_tp":
        policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return {**llama_tp_plan(), "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    return llama_tp_plan(sequence_parallel=True, loss_parallel=True)  # data parallel over "dp"


@pytest.mark.slow
@pytest.mark.parametrize("plan_name,layers", [("fsdp_bf16_tp", 3), ("dp_tp_sp_loss_parallel", 4)])
def test_compile_dumps_are_byte_identical(tmp_path, plan_name, layers):
    """On a 2x2 mesh: FSDP (bf16 params, fp32 reduce) x TP, and DP x TP with sequence parallelism
    and the vocab-parallel loss. With two blocks traced, propagated and lowered and the others
    copied, every dumped stage, from the captured graph and each rewrite to the partitioned
    programs, the layouts, memory and timeline, is the same file as when every block goes through
    every step; so are the summary's propagation report lines."""
    plan = _dump_plan(plan_name)
    summaries = {}
    with fake_world(4, 1):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for option in (None, "model.layers"):
            with hp.init_empty_weights():
                model = build_model("llama", num_hidden_layers=layers)
            ids = torch.empty(4, 16, dtype=torch.long, device="meta")
            pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids},
                                         dump_dir=str(tmp_path / str(option)), repeated_blocks=option)
            summaries[option] = pmodel.compile_summary()
    assert summaries["model.layers"]["repeated_blocks"] == \
        f"2 of {layers} blocks of model.layers traced, propagated and lowered"
    assert summaries[None]["repeated_blocks"] == ""
    for key in ("fallbacks", "plan_redistributions", "collectives"):
        assert summaries[None][key] == summaries["model.layers"][key], key
    assert summaries[None]["plan_redistributions"], "the plan changes layouts at module boundaries"
    traced, copied = tmp_path / "None" / "rank1", tmp_path / "model.layers" / "rank1"
    names = sorted(os.listdir(traced))
    assert names == sorted(os.listdir(copied)) and "17_backward.py" in names and "00d_fsdp_unshard.py" in names, names
    for name in names:
        assert (traced / name).read_bytes() == (copied / name).read_bytes(), name


class _Block(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = scale

    def forward(self, x, bias=None):
        h = x + self.down(torch.relu(self.up(x))) * self.scale
        return h if bias is None else h + bias


class _Stack(nn.Module):
    """Blocks over a residual stream, then a loss; ``mode`` makes one thing differ per block."""

    def __init__(self, mode: str = "", n: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(n))
        self.biases = nn.Parameter(torch.zeros(n, 8))
        self.mode = mode
        if mode == "attribute":
            self.layers[3].scale = 0.5
        if mode == "hook":
            self.layers[2].down.register_forward_hook(lambda m, i, o: o * 2)

    def forward(self, x, target):
        x = self.embed(x)  # block 0's input requires grad, as an embedding's output does
        rows = self.biases.unbind(0) if self.mode == "outside input" else None  # before the blocks run
        # transformers' decoders loop over self.layers[: config.num_hidden_layers]: every block
        blocks = self.layers[: len(self.biases)] if self.mode == "whole slice" else self.layers
        for i, block in enumerate(blocks):
            if self.mode == "outside input":
                x = block(x, rows[i])  # each block reads its own row: not copyable
            elif self.mode == "checkpoint":
                x = hp.checkpoint(block, x)  # a region per call: the regions differ
            else:
                x = block(x)
        if self.mode == "len":
            x = x / len(self.layers)  # a formula with the number of blocks
        if self.mode == "last":
            x = self.layers[-1](x)  # the last block again: block 1 in a two-block trace
        if self.mode == "slice":
            for block in self.layers[1:3]:  # blocks 1 and 2: one block in a two-block trace
                x = block(x)
        if self.mode == "range":
            for i in range(4):  # an index past the traced blocks: an IndexError in a two-block trace
                x = self.layers[i](x)
        return {"loss": torch.nn.functional.mse_loss(x, target)}


@pytest.mark.parametrize("mode,why", [
    ("attribute", "attribute 'scale' differs between blocks"),
    ("hook", "block 2's hooks on 'down' differ from block 1's"),
    ("outside input", "the blocks read different values from outside"),
    ("len", "the forward computes with the number of blocks (len() at "),
    ("last", "the forward computes with the number of blocks (index [-1] at "),
    ("slice", "the forward computes with the number of blocks (slice [1:3:None] at "),
    ("range", "the forward computes with the number of blocks (index [2] at "),
])
def test_blocks_that_differ_are_all_traced(mode, why, caplog):
    torch.manual_seed(0)
    model = _Stack(mode)
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    full = capture(model, (x, target), {})
    with caplog.at_level(logging.INFO, logger="hyper_parallel.compile.repeated.capture"):
        copied, traced = _captured(capture_blocks_once(model, (x, target), {}, {}, {}, "auto", lambda: None))
    assert traced == "" and why in caplog.text, caplog.text
    _assert_same_capture(full, copied)


def test_checkpointed_blocks_are_all_traced(caplog):
    """hp.checkpoint marks a region per call: block 1's region cannot stand for block 2's, so the
    two-block trace is abandoned (and its recorded regions forgotten)."""
    from hyper_parallel.recompute import annotated_regions, capturing, forget_annotated_regions

    torch.manual_seed(0)
    model = _Stack("checkpoint")
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    with capturing():
        full = capture(model, (x, target), {})
        full_regions = len(annotated_regions())
    with capturing(), caplog.at_level(logging.INFO, logger="hyper_parallel.compile.repeated.capture"):
        copied, traced = _captured(
            capture_blocks_once(model, (x, target), {}, {}, {}, "layers", forget_annotated_regions))
        regions = len(annotated_regions())
    assert traced == "" and "different annotations" in caplog.text, caplog.text
    assert regions == full_regions == 4
    assert len(copied.gm.graph.nodes) == len(full.gm.graph.nodes)


def test_a_slice_of_every_block_is_copied():
    """``self.layers[:num_hidden_layers]`` (transformers' decoder loop) takes the whole list: the
    two-block trace stands for it, and its copies equal tracing every block."""
    torch.manual_seed(0)
    model = _Stack("whole slice")
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    full = capture(model, (x, target), {})
    copied, traced = _captured(capture_blocks_once(model, (x, target), {}, {}, {}, "auto", lambda: None))
    assert traced == "2 of 4 blocks of layers traced"
    _assert_same_capture(full, copied)


def test_identical_blocks_copy_exactly():
    torch.manual_seed(0)
    model = _Stack(n=5)
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    full = capture(model, (x, target), {})
    copied, traced = _captured(capture_blocks_once(model, (x, target), {}, {}, {}, "layers", lambda: None))
    assert traced == "2 of 5 blocks of layers traced"
    _assert_same_capture(full, copied)
    # And they compute the same loss and gradients, called as the joint graph is: (primals, tangents).
    primals, tangents = [*(p.detach() for p in model.parameters()), x, target], [torch.ones(())]
    torch.testing.assert_close(copied.gm(primals, tangents), full.gm(primals, tangents))


def test_option_is_checked_at_parallelize():
    model = _Stack()
    assert check_option(None, model) is None and check_option("auto", model) == "auto"
    assert check_option("layers", model) == "layers"
    with pytest.raises(ValueError, match=r"repeated_blocks='blocks'.*its ModuleLists are \['layers'\]"):
        check_option("blocks", model)
    with pytest.raises(TypeError, match="repeated_blocks is None, 'auto' or the FQN of a ModuleList"):
        check_option(True, model)


def test_blocks_are_copied_by_default(caplog):
    """``repeated_blocks="auto"`` is parallelize's default: the example Llama's four layers compile
    as two traced and two copied; ``None`` traces every block. A model whose lists are too short to
    copy says so only at DEBUG (it is the default's normal case), a longer one that cannot be copied
    at INFO."""
    summaries = {}
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for options in ({}, {"repeated_blocks": None}):
            with hp.init_empty_weights():
                model = build_model("llama", num_hidden_layers=4)
            ids = torch.empty(4, 16, dtype=torch.long, device="meta")
            pmodel = compile_for_explain(model, {}, mesh, (), {"input_ids": ids, "labels": ids}, **options)
            summaries[str(options)] = pmodel.compile_summary()["repeated_blocks"]
    assert summaries == {"{}": "2 of 4 blocks of model.layers traced, propagated and lowered",
                         "{'repeated_blocks': None}": ""}
    torch.manual_seed(0)
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    with caplog.at_level(logging.INFO, logger="hyper_parallel.compile.repeated.capture"):
        capture_blocks_once(_Stack(n=2), (x, target), {}, {}, {}, "auto", lambda: None)
    assert "tracing every block" not in caplog.text, caplog.text
    with caplog.at_level(logging.DEBUG, logger="hyper_parallel.compile.repeated.capture"):
        capture_blocks_once(_Stack(n=2), (x, target), {}, {}, {}, "auto", lambda: None)
    assert "layers: 2 blocks: copying pays from 3" in caplog.text, caplog.text
