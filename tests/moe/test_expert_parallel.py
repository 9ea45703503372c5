"""Expert parallelism (hp.ExpertParallel): parity with one device (loss and every gradient, 3 SGD
steps) for the example MoE and HF Mixtral / Qwen2-MoE, on ep=2, ep=4 and dp x ep; the dispatch and
combine all-to-alls read from the compiled programs; errors a user meets on a real mesh."""

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.ir import meta
from hyper_parallel.testing.parity import build_model, build_plan, error_message, global_batch, local_batch, run_parity
from hyper_parallel.testing.stepper import ParityStepper, batches, strided

A2A = torch.ops._c10d_functional.all_to_all_single.default
MM = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default}


def test_ep2_parity_and_collectives(dist2):
    """4 experts over 2 ranks, 2 MoE layers: per layer and step, forward exchanges the rows per
    expert, dispatches and combines; backward runs the two transposes; nothing else crosses ep but
    the dense gradients' all-reduce and the loss's scalars."""
    results = dist2.run(run_parity, "moe", "ep", (2,), ("ep",), model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    assert collectives["forward"]["all_to_all"]["ep"]["count"] == 2 * 3
    assert collectives["backward"]["all_to_all"]["ep"]["count"] == 2 * 2
    # One gradient bucket, and the load-balancing loss's gradient rows over the experts ([E] floats
    # per MoE layer, reduced before they are broadcast over the tokens), both layers' in one
    # all-reduce (fuse_small_reductions).
    assert collectives["backward"]["all_reduce"]["ep"] == {"count": 1 + 1, "bytes": 232_704 + 2 * 4 * 4}
    assert results[0]["losses"] == results[1]["losses"]


def test_ep4_sigmoid_router_shared_expert_dense_first_layer(dist4):
    """8 experts over 4 ranks (2 each), DeepSeek-style: sigmoid scores, a shared expert, the
    first layer dense."""
    dist4.run(run_parity, "moe", "ep", (4,), ("ep",), model_overrides={
        "num_hidden_layers": 3, "num_experts": 8, "score_func": "sigmoid",
        "shared_expert_intermediate_size": 16, "first_k_dense_layers": 1,
    })


def test_dp_times_ep_with_padded_labels(dist4):
    """dp=2 x ep=2: experts are replicated over dp (their gradients all-reduced over dp only), every
    rank takes different rows; labels padded so ranks count different tokens."""
    results = dist4.run(run_parity, "moe", "ep", (2, 2), ("dp", "ep"), model_overrides={"num_hidden_layers": 2},
                        ignore_fraction=0.3)
    collectives = results[0]["summary"]["collectives"]
    assert set(collectives["forward"]["all_to_all"]) == {"ep"}  # tokens never cross dp
    assert collectives["backward"]["all_reduce"]["dp"]["bytes"] > collectives["backward"]["all_reduce"]["ep"]["bytes"]


# transformers' batched experts kernel (no data-dependent shapes of its own); the router's
# auxiliary loss on, so the returned loss includes it.
HF_MOE = {"experts_implementation": "batched_mm", "output_router_logits": True, "router_aux_loss_coef": 0.01}


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_hf_moe_models_ep2(dist2, arch):
    """transformers' Mixtral, Qwen2-MoE and DeepSeek-V3 unchanged (router auxiliary loss included
    where the model has one; shared experts, DeepSeek's dense first layer and its latent attention
    stay data-parallel): their experts modules become expert regions. No op runs replicated (under
    plain DP, HF's grouped experts gather every routed token; DeepSeek's latent attention's
    ``expand_kv`` copy ran replicated until the functional ``copy`` had a rule,
    propagation/elementwise_rules.py)."""
    overrides = HF_MOE if arch != "DeepseekV3ForCausalLM" else {"experts_implementation": "batched_mm"}
    results = dist2.run(run_parity, f"hf:{arch}", "ep", (2,), ("ep",), model_overrides=overrides,
                        ignore_fraction=0.3)
    assert results[0]["summary"]["fallbacks"] == []


def _program_structure(batch: int, seq_len: int) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    model = build_model("moe", num_hidden_layers=2)
    pmodel = hp.parallelize(model, build_plan("ep"), mesh)
    out = pmodel(**local_batch(global_batch("moe", batch, seq_len), mesh))
    out["loss"].backward()
    programs = dict(zip(("forward", "backward"), pmodel.compiled_programs()))
    result = {"summary": pmodel.compile_summary()["collectives"]}
    for phase, gm in programs.items():
        rows = []
        for i, node in enumerate(gm.graph.nodes):
            if node.target is A2A or node.target in MM:
                val = node.args[0].meta["val"]
                rows.append({"index": i, "a2a": node.target is A2A, "what": node.meta.get(meta.REDISTRIBUTE, ""),
                             "source": node.meta.get(meta.SOURCE, ""), "dtype": str(val.dtype),
                             "shape": [s if isinstance(s, int) else str(s) for s in val.shape]})
        result[phase] = rows
    return result


def test_dispatch_and_combine_sit_around_the_experts(dist2):
    """Read from the compiled programs: per MoE layer, forward issues the rows-per-expert exchange
    and the dispatch before the layer's expert matmuls and the combine after them; backward runs
    the combine's transpose before the experts' backward matmuls and the dispatch's after. The
    sizes are analytic: T local tokens x top-k rows of hidden size leave each rank (dispatch input,
    combine-transpose input); received rows are data-dependent (symbolic sizes in the program)."""
    batch, seq, layers, k, hidden, experts = 4, 16, 2, 2, 64, 4
    structure = dist2.run(_program_structure, batch, seq)[0]
    rows_out = batch // 2 * seq * k
    for phase, order in (("forward", ["rows per expert", "dispatch", "combine"]),
                         ("backward", ["combine (backward)", "dispatch (backward)"])):
        rows = structure[phase]
        for layer in range(layers):
            fqn = f"model.layers.{layer}.mlp.experts"
            a2a = [r for r in rows if r["a2a"] and fqn + ":" in r["what"]]
            assert [r["what"].split(": ")[1] for r in a2a] == order, (phase, a2a)
            source = a2a[0]["source"]
            matmuls = [r["index"] for r in rows if not r["a2a"] and r["source"] == source]
            assert matmuls, f"no expert matmul of {fqn} in {phase}"
            sends = [r for r in a2a if r["what"].endswith(("dispatch", "combine (backward)"))]
            receives = [r for r in a2a if r["what"].endswith(("combine", "dispatch (backward)"))]
            assert sends[0]["index"] < min(matmuls) and max(matmuls) < receives[0]["index"], (phase, fqn)
            assert sends[0]["shape"] == [rows_out, hidden] and sends[0]["dtype"] == "torch.float32"
            assert any("u" in str(s) for s in receives[0]["shape"]), receives[0]  # data-dependent rows
            if phase == "forward":
                assert a2a[0]["shape"] == [experts] and a2a[0]["dtype"] == "torch.int64"
    # Summary bytes: per layer the count exchange plus two T*k*hidden fp32 transfers (the received
    # side counted at its balanced-routing estimate, which is the same size).
    forward = structure["summary"]["forward"]["all_to_all"]["ep"]
    assert forward["bytes"] == layers * (experts * 8 + 2 * rows_out * hidden * 4)
    assert structure["summary"]["backward"]["all_to_all"]["ep"]["bytes"] == layers * 2 * rows_out * hidden * 4


def _unused_ep_axis() -> str:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    return error_message(hp.parallelize, build_model("moe", num_hidden_layers=1), {}, mesh)


def test_ep_axis_without_an_expert_entry(dist2):
    message = dist2.run(_unused_ep_axis)[0]
    assert message.startswith("ValueError: mesh axis 'ep' (size 2) is used by no plan entry"), message
    assert "expert_parallel={'model.layers.*.mlp.experts': hp.ExpertParallel()}" in message


EP_FSDP = {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel()},
           "fully_shard": {"units": ["model.layers.*", ""]}}


def _stored(model, names) -> dict:
    params = dict(model.named_parameters())
    return {n: (str(params[n].placements), tuple(params[n].to_local().shape)) for n in names}


def _ep_fsdp_storage() -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    model = hp.parallelize(build_model("moe", num_hidden_layers=2), EP_FSDP, mesh)
    return _stored(model, ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_proj"])


def test_ep_times_fsdp_parity(dist4):
    """dp_shard=2 x ep=2: each expert weight is sharded over the dp_shard ranks that hold the same
    experts (torchtitan's dp_shard_mod_ep) and gathered per layer; dense weights are sharded over
    all four data-parallel ranks (dp_shard x ep) and gathered and reduce-scattered over both at
    once, on the mesh flattened over the two (``dp_shard+ep``, which parallelize creates on this
    plain mesh): no dense gradient is all-reduced over ep any more, and nothing runs once per axis."""
    results = dist4.run(run_parity, "moe", EP_FSDP, (2, 2), ("dp_shard", "ep"), ignore_fraction=0.3,
                        model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    # Per unit one fused gather of its dense weights over dp_shard x ep, and in each MoE layer one of
    # its expert weights over dp_shard; the gradients likewise.
    assert collectives["forward"]["all_gather"] == {
        "dp_shard+ep": {"count": 3, "bytes": 58176}, "dp_shard": {"count": 2, "bytes": 49152}}
    assert collectives["backward"]["reduce_scatter"] == {
        "dp_shard+ep": {"count": 3, "bytes": 232704}, "dp_shard": {"count": 2, "bytes": 98304}}
    # What is left in backward besides: the load-balancing loss's [E] gradient rows, one fused
    # all-reduce of 2 layers x 4 experts x fp32, over the same flattened group.
    assert collectives["backward"]["all_reduce"] == {"dp_shard+ep": {"count": 1, "bytes": 2 * 4 * 4}}
    assert collectives["forward"]["all_to_all"]["ep"]["count"] == 2 * 3
    stored = dist4.run(_ep_fsdp_storage)[0]
    assert stored["model.layers.0.self_attn.q_proj.weight"] == ("(Shard(dim=0), Shard(dim=0))", (16, 64))
    # 4 experts: 2 per ep rank, split again over dp_shard (one each), strided inside the ep shard.
    assert stored["model.layers.0.mlp.experts.gate_proj"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", (1, 64, 32))


def _ep_fsdp_gradient_accumulation(micro_steps: int = 2) -> None:
    """Micro-steps without gradient sync, then one with it, against one device on the whole batch:
    a kept dense gradient is a partial sum over ep as well as dp_shard, an expert gradient only
    over dp_shard (each ep rank holds its own experts' whole gradient)."""
    import copy

    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    # Without the load-balancing loss: its batch statistics do not add up over micro-steps.
    reference = build_model("moe", num_hidden_layers=2, router_aux_loss_coef=0.0)
    model = hp.parallelize(copy.deepcopy(reference), EP_FSDP, mesh)

    def sync_last(record, i):
        model.set_requires_gradient_sync(i == micro_steps - 1)

    # One step: every gradient after the micro-steps (each loss / micro_steps) against the whole batch.
    ParityStepper(reference, model, mesh=mesh, batch=batches("moe", batch=4 * micro_steps), optimizer=None,
                  micro_batches=micro_steps, split=strided, reference_micro_batches=1, check_loss=False,
                  micro_context=sync_last).run(1)


def test_ep_times_fsdp_gradient_accumulation(dist4):
    dist4.run(_ep_fsdp_gradient_accumulation)


def _ep_fsdp_bf16(mesh_kind: str, steps: int = 2) -> dict:
    """bf16 compute / fp32 reduce (FSDP2's MixedPrecisionPolicy) against one device computing in
    bf16 from the same fp32 master weights; also where the reduce-scatters sit in backward, and
    how many collectives of one group each program has in flight. ``mesh_kind``: "plain" or
    "parallel_dims" (whose mesh has its flattened aliases from the start)."""
    import copy

    import torch.distributed as dist

    from hyper_parallel.testing.pass_inputs import in_flight_per_group

    if mesh_kind == "parallel_dims":
        mesh = hp.ParallelDims(dp_shard=2, ep=2, world_size=4).build_mesh("cpu")
    else:
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    # One expert per ep rank (top-1 of 2): dim 0 cannot split over dp_shard, so the expert weights
    # are FSDP-sharded on dim 1 (as torchtitan does when dp_shard x ep > experts). The router's
    # [2, hidden] weight does not divide over dp_shard x ep: it is stored sharded on dim 1 (a
    # nested uneven dim-0 shard is gathered wrongly by DTensor over the flattened mesh).
    master = build_model("moe", num_hidden_layers=2, num_experts=2, num_experts_per_tok=1)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {**EP_FSDP, "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    # Against one device computing in bf16 from the fp32 master (which steps with its gradients).
    ParityStepper(master, model, mesh=mesh, batch=batches("moe", ignore_fraction=0.3), bf16_reference=True).run(steps)
    forward, backward = model.compiled_programs()
    nodes = list(backward.graph.nodes)
    scatters = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    expert_mm = [i for i, n in enumerate(nodes) if n.target in MM and "experts" in n.meta.get(meta.SOURCE, "")]
    in_flight = {**in_flight_per_group(forward), **in_flight_per_group(backward)}
    return {"rank": dist.get_rank(), "scatters": scatters, "expert_mm": expert_mm, "length": len(nodes),
            "in_flight": in_flight, "stored": _stored(model, ["model.layers.0.mlp.experts.down_proj",
                                                              "model.layers.0.mlp.router.gate.weight"])}


@pytest.mark.parametrize("mesh_kind", ["plain", "parallel_dims"])
def test_ep_times_fsdp_bf16_reductions_overlap_backward(dist4, mesh_kind):
    """Mixed precision, one expert per ep rank (its weights FSDP-sharded on dim 1): the loss and
    every fp32 gradient track the bf16 single-device run, and the
    first FSDP reduce-scatter is issued before the first layer's expert backward matmuls (the
    last layer's gradients reduce while earlier layers still compute), not after all of backward.
    On a ParallelDims mesh (its flattened aliases there from the start) this gave a silently wrong
    loss and gradients until the router's uneven weight was stored sharded on dim 1. On gloo every
    group, the flattened one included, has one collective in flight at a time."""
    for result in dist4.run(_ep_fsdp_bf16, mesh_kind):
        assert result["stored"]["model.layers.0.mlp.experts.down_proj"] == ("(Shard(dim=1), Shard(dim=0))", (1, 16, 64))
        router = result["stored"]["model.layers.0.mlp.router.gate.weight"]
        assert router == ("(Shard(dim=1), Shard(dim=1))", (2, 16))
        assert max(result["in_flight"].values()) == 1, result["in_flight"]
        assert result["scatters"] and result["expert_mm"]
        assert result["scatters"][0] < max(result["expert_mm"]), result


def _untraceable_experts() -> str:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    model = build_model("hf:MixtralForCausalLM", experts_implementation="eager")
    pmodel = hp.parallelize(model, build_plan("ep"), mesh)
    return error_message(lambda: pmodel(**local_batch(global_batch("hf:MixtralForCausalLM", 4, 16), mesh)))


def test_experts_that_branch_on_routing_are_named(dist2):
    """HF's "eager" experts loop over the experts that got tokens (Python control flow on tensor
    values): the error names the module, the line and the fix instead of torch's guard error."""
    message = dist2.run(_untraceable_experts)[0]
    assert message.startswith("ValueError: expert_parallel['model.layers.*.mlp.experts']: the forward of "
                              "experts module 'model.layers.0.mlp.experts' (MixtralExperts) cannot run on a "
                              "data-dependent number of rows at "), message
    assert "modeling_mixtral.py" in message and "set_experts_implementation('batched_mm')" in message


def _parallel_dims_mesh() -> dict:
    import copy

    pd = hp.ParallelDims(dp_shard=2, ep=2, world_size=4)
    mesh = pd.build_mesh("cpu")
    reference = build_model("moe", num_hidden_layers=1)
    model = hp.parallelize(copy.deepcopy(reference), EP_FSDP, mesh)
    full = global_batch("moe", 4, 16)
    loss = model(**local_batch(full, mesh))["loss"]
    ref_loss = reference(**full)["loss"]
    loss.backward(), ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, msg=lambda m, name=name: f"{name}: {m}")
    return {"names": mesh.mesh_dim_names, "dp": pd.get_mesh("dp").size(), "loss": pd.get_mesh("loss").size()}


def test_parallel_dims_mesh_goes_straight_into_parallelize(dist4):
    result = dist4.run(_parallel_dims_mesh)[0]
    assert result == {"names": ("dp_shard", "ep"), "dp": 4, "loss": 4}


@pytest.mark.parametrize("schedule,aux", [("1F1B", False), ("ZBH1", True)])
def test_ep_with_pipeline_stages(dist4, schedule, aux):
    """pp=2 x ep=2, one MoE layer per stage, 2 micro-batches (ZB-H1 also cuts each stage's backward
    into input- and weight-gradient programs), padded labels. Without the router's load-balancing
    loss the loss is the exact token mean over the whole batch. With it the loss is no plain token
    mean: the load-balancing term is computed per micro-batch (as torchtitan and Megatron do; its
    batch statistics cannot span micro-batches whose backward runs before the next forward), the
    step averages the micro-batch losses, and one device accumulating over the same micro-batches
    is the reference; the pipeline says so (its summary, and a warning at compile)."""
    from hyper_parallel.testing.parity import run_pipeline_parity

    plan = {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel()},
            "pipeline": hp.PipelinePlan(split_points=["model.layers.1"], num_microbatches=2, schedule=schedule)}
    results = dist4.run(run_pipeline_parity, plan, (2, 2), ("pp", "ep"), num_layers=2, model="moe",
                        model_overrides={} if aux else {"router_aux_loss_coef": 0.0}, ignore_fraction=0.3,
                        reference_microbatches=2 if aux else 1)
    summary = results[0]["summary"]
    assert summary["loss"] == ("mean of the micro-batch losses" if aux else "token mean over the step")
    # One MoE layer per stage: per micro-batch 3 all-to-alls forward and 2 backward.
    assert summary["collectives_per_step"]["all_to_all"]["ep"]["count"] == 2 * 5


def test_ep_times_expert_tensor_parallel(dist4):
    """ep=2 x tp=2 (ExpertTensorParallel): experts spread over ep, each expert's gate/up split by
    columns and down by rows over tp, attention tensor-parallel too; tokens are dispatched over ep
    only and the experts' partial outputs all-reduced over tp."""
    results = dist4.run(run_parity, "moe", "ep_tp", (2, 2), ("ep", "tp"), model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    assert set(collectives["forward"]["all_to_all"]) == {"ep"}


def test_hf_mixtral_fused_gate_up_under_expert_tensor_parallel(dist4):
    """transformers' Mixtral keeps gate and up in one weight, ``gate_up_proj`` [E, 2I, H], whose
    forward splits with ``chunk(2)``: ep=2 x tp=2 splits it as two halves (each tp rank holds its
    columns of gate and of up, a strided shard) and ``down_proj`` [E, H, I] by its input dim."""
    style = hp.ExpertTensorParallel(shard_dims={"gate_up_proj": 1, "down_proj": 2})
    plan = {"expert_parallel": {"model.layers.*.mlp.experts": style}}
    results = dist4.run(run_parity, "hf:MixtralForCausalLM", plan, (2, 2), ("ep", "tp"),
                        model_overrides=HF_MOE, ignore_fraction=0.3)
    collectives = results[0]["summary"]["collectives"]
    assert set(collectives["forward"]["all_to_all"]) == {"ep"}
    assert "tp" in collectives["forward"]["all_reduce"]  # the experts' partial outputs


def test_expert_weight_tensor_parallel_without_ep(dist2):
    """The reference's TensorParallel on expert weights (hp.ExpertWeightTensorParallel): every rank
    keeps all experts, split over tp; no all-to-all at all."""
    results = dist2.run(run_parity, "moe", "expert_tp", (2,), ("tp",), model_overrides={"num_hidden_layers": 2})
    collectives = results[0]["summary"]["collectives"]
    assert "all_to_all" not in collectives["forward"] and "all_to_all" not in collectives["backward"]


OVERLAP = {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel(overlap=True)}}


@pytest.mark.parametrize("disable", [(), ("expert_overlap",)])
def test_overlap_parity_with_the_pass_on_and_off(dist2, disable):
    """overlap=True (the reference's CommComputeOverlap) runs each layer as two token chunks; the
    expert_overlap pass only reorders them, so both give one device's numbers."""
    results = dist2.run(run_parity, "moe", OVERLAP, (2,), ("ep",), model_overrides={"num_hidden_layers": 2},
                        disable_passes=disable, ignore_fraction=0.3)
    # Two chunks: twice the all-to-alls of test_ep2_parity_and_collectives, the same bytes.
    assert results[0]["summary"]["collectives"]["forward"]["all_to_all"]["ep"]["count"] == 2 * 2 * 3


def _overlap_schedule() -> dict:
    import copy

    from hyper_parallel.passes.expert_overlap import expert_overlap

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    pmodel = hp.parallelize(build_model("moe", num_hidden_layers=1), OVERLAP, mesh)
    pmodel(**local_batch(global_batch("moe", 4, 16), mesh))["loss"].backward()
    result = {}
    for phase, gm in zip(("forward", "backward"), pmodel.compiled_programs()):
        rows = []
        for i, node in enumerate(gm.graph.nodes):
            chunk = node.meta.get(meta.EXPERT_CHUNK)
            if chunk is None:
                continue
            kind = "a2a" if node.target is A2A else "wait" if node.target is torch.ops._c10d_functional.wait_tensor.default \
                else "mm" if node.target in MM else None
            if kind == "wait" and node.args[0].target is not A2A:
                kind = None
            if kind:
                what = node.meta.get(meta.REDISTRIBUTE, "") if kind == "a2a" else \
                    node.args[0].meta.get(meta.REDISTRIBUTE, "") if kind == "wait" else ""
                rows.append({"index": i, "kind": kind, "chunk": int(chunk.rsplit("#", 1)[1]), "what": what})
        once = expert_overlap(copy.deepcopy(gm))
        order = [n.name for n in once.graph.nodes]
        result[phase] = {"rows": rows, "idempotent": [n.name for n in expert_overlap(once).graph.nodes] == order}
    return result


def test_overlap_schedule_read_from_the_programs(dist2):
    """Forward: chunk 1's dispatch is issued before chunk 0's expert matmuls and waited for after
    them; chunk 0's combine is in flight while chunk 1's experts compute. Backward: chunk 1's
    combine transpose (its first all-to-all) is in flight during chunk 0's expert backward. A
    second run of the pass changes nothing."""
    result = dist2.run(_overlap_schedule)[0]
    for phase, send, receive in (("forward", "dispatch", "combine"),
                                 ("backward", "combine (backward)", "dispatch (backward)")):
        rows, idempotent = result[phase]["rows"], result[phase]["idempotent"]
        assert idempotent, phase

        def at(kind, chunk, what):
            return next(r["index"] for r in rows if r["kind"] == kind and r["chunk"] == chunk and r["what"].endswith(what))

        mm = {c: [r["index"] for r in rows if r["kind"] == "mm" and r["chunk"] == c] for c in (0, 1)}
        assert at("a2a", 1, send) < min(mm[0]) and max(mm[0]) < at("wait", 1, send), (phase, rows)
        assert at("a2a", 0, receive) < min(mm[1]) and max(mm[1]) < at("wait", 0, receive), (phase, rows)


@pytest.mark.parametrize("activations", [{"recompute": {"model.layers.*": "full"}},
                                         {"recompute": {"model.layers.*": "selective"}},
                                         {"swap": {"model.layers.*": True}}], ids=["full", "selective", "swap"])
def test_ep_with_recompute_and_swap(dist2, activations):
    """Full recompute re-runs each layer's forward in backward, its three all-to-alls included
    (every rank recomputes the same ones); selective keeps the all-to-alls' results (none re-runs);
    swap keeps the layer's saved values in host memory."""
    plan = {"expert_parallel": {"model.layers.*.mlp.experts": hp.ExpertParallel()}, **activations}
    results = dist2.run(run_parity, "moe", plan, (2,), ("ep",), model_overrides={"num_hidden_layers": 2})
    backward = results[0]["summary"]["collectives"]["backward"]["all_to_all"]["ep"]["count"]
    assert backward == 2 * (2 + (3 if activations.get("recompute", {}).get("model.layers.*") == "full" else 0))
