"""Lowering of the expert-region ops: dropless dispatch, the experts on local rows, combine.

Called by compile/lower.py for each ``hyper_parallel::experts`` / ``experts_backward`` node with
this rank's local tensors (already moved to the layouts moe/propagation.py chose). Traced under
lowering's ``make_fx``, so everything below becomes nodes of the local joint graph:

forward, per rank (``T`` local tokens, ``k`` choices, ``E`` experts, ``ep`` ranks on the axis):
  1. the ``T*k`` (token, choice) rows sorted by expert (stable), tokens gathered in that order;
  2. rows per expert (``[E]``) exchanged by an all-to-all of fixed size, then read to the host: the
     send and receive split sizes (data-dependent, unbacked symbolic sizes in the trace);
  3. **dispatch**: ``all_to_all_single`` of the sorted rows with those splits; received rows are
     grouped by source rank, then by local expert;
  4. the experts module's own forward on the received rows, with this rank's ``E/ep`` expert
     weights, local expert ids and routing weights of one (so it returns each row's expert output);
     ``num_experts`` on the module reads ``E/ep`` while it is traced. With expert tensor
     parallelism the weights are this rank's columns / rows of each expert, the outputs partial
     sums, all-reduced over the tp axis (and the input gradient likewise in backward);
  5. **combine**: the transposed all-to-all brings every row's output home, rows return to
     (token, choice) order and are weighted and summed over the choices as the module does.

The forward keeps the autograd graph of steps 3–5 (leaves: tokens, routing weights, expert
weights); the backward op calls ``torch.autograd.grad`` on it, which traces the transposes: the
output gradient's dispatch all-to-all, the experts' backward, the combine all-to-all back, with
the forward's split sizes. No capacity factor and no dropped rows: results equal one device.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from .. import compat
from ..ir import meta
from .resolve import ExpertRegionPlan


def _all_to_all(x: torch.Tensor, output_splits, input_splits, group_name: str, what: str) -> torch.Tensor:
    with fx_traceback.annotate({meta.ROLE: meta.ROLE_REDISTRIBUTE, meta.REDISTRIBUTE: what}):
        out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), output_splits, input_splits, group_name)
        return torch.ops._c10d_functional.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """Differentiable variable-size all-to-all: its backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group_name, what):
        ctx.splits = (output_splits, input_splits)
        ctx.group_name, ctx.what = group_name, what
        return _all_to_all(x, output_splits, input_splits, group_name, what)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group_name, f"{ctx.what} (backward)"), None, None, None, None


def _all_reduce(x: torch.Tensor, group_name: str, what: str) -> torch.Tensor:
    with fx_traceback.annotate({meta.ROLE: meta.ROLE_REDISTRIBUTE, meta.REDISTRIBUTE: what}):
        return torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name))


class _SumOverTensorParallel(torch.autograd.Function):
    """Expert tensor parallelism's partial outputs summed over the tp ranks; backward: identity."""

    @staticmethod
    def forward(ctx, x, group_name, what):
        return _all_reduce(x, group_name, what)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _IntoTensorParallel(torch.autograd.Function):
    """Forward: identity (every tp rank has the rows); backward: the partial input gradients of the
    split weights summed over the tp ranks."""

    @staticmethod
    def forward(ctx, x, group_name, what):
        ctx.group_name, ctx.what = group_name, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group_name, ctx.what), None, None


@contextlib.contextmanager
def _num_experts(module: nn.Module, n: int):
    """The module's ``num_experts`` reads the local count while its forward is traced on local weights."""
    if not hasattr(module, "num_experts"):
        yield
        return
    old = module.__dict__.get("num_experts")
    module.num_experts = n
    try:
        yield
    finally:
        if old is None:
            del module.num_experts
        else:
            module.num_experts = old


def _region_forward(x, top_k_index, top_k_weights, params, region: ExpertRegionPlan, module: nn.Module,
                    group_name: str | None, tp_group_name: str | None):
    tokens, k = top_k_index.shape
    ep, local = region.degree, region.local_experts
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    if ep > 1:
        counts = torch.zeros(region.num_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, expert_ids, torch.ones_like(expert_ids)
        )
        where = f"experts {region.module_fqn}"
        received_counts = _all_to_all(counts, [local] * ep, [local] * ep, group_name, f"{where}: rows per expert")
        send = counts.view(ep, local).sum(1).tolist()
        # Every local row goes to some rank: written as the rest, the splits sum to tokens * k in
        # the trace too, so the combine brings back a static number of rows.
        send[-1] = tokens * k - sum(send[:-1])
        receive = received_counts.view(ep, local).sum(1).tolist()
        for size in send + receive:  # what memory and cost estimates assume: balanced routing
            compat.set_size_hint(size, tokens * k // ep)
        received = _AllToAll.apply(rows, receive, send, group_name, f"{where}: dispatch")
        local_ids = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), received_counts, output_size=received.shape[0]
        )
    else:
        received, local_ids = rows, expert_ids.index_select(0, order)
    ones = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=x.device)
    if tp_group_name is not None:
        received = _IntoTensorParallel.apply(received, tp_group_name,
                                             f"experts {region.module_fqn}: input gradient summed over {region.tp_axis}")
    with _num_experts(module, local):
        outputs = torch.func.functional_call(
            module, dict(zip(region.param_names, params)), (received, local_ids.unsqueeze(1), ones)
        )
    if tp_group_name is not None:
        outputs = _SumOverTensorParallel.apply(outputs, tp_group_name,
                                               f"experts {region.module_fqn}: sum over {region.tp_axis}")
    if ep > 1:
        outputs = _AllToAll.apply(outputs, send, receive, group_name, f"{where}: combine")
    per_choice = torch.empty_like(outputs).index_copy(0, order, outputs)
    weighted = per_choice.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(1).to(x.dtype)


def _untraceable(region: ExpertRegionPlan, module: nn.Module, exc: Exception) -> ValueError:
    """The error for an experts module whose forward cannot run on a data-dependent row count."""
    torch_dir = os.path.dirname(torch.__file__)
    ours = os.path.dirname(os.path.dirname(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((torch_dir, ours))]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""
    return ValueError(
        f"{region.source}: the forward of experts module {region.module_fqn!r} ({type(module).__name__}) "
        f"cannot run on a data-dependent number of rows{where} ({str(exc).splitlines()[0]}). Each rank "
        "receives however many rows the router sends its experts, so the module must not branch on "
        "tensor values. For transformers MoE models call model.set_experts_implementation('batched_mm') "
        "(or 'grouped_mm' in bf16 on GPUs); in your own module loop over the experts with "
        "torch.split(rows, counts.tolist()) as hyper_parallel.models.moe.MoEExperts does."
    )


class ExpertLowering:
    """Per-lowering state: the experts modules and the autograd graphs between forward and backward."""

    def __init__(self, regions: dict, mesh):
        self.regions = regions  # module fqn -> (ExpertRegionPlan, module)
        self.mesh = mesh
        self.pending: dict[str, tuple] = {}

    def _group_name(self, axis: str | None, degree: int) -> str | None:
        if axis is None or degree == 1:
            return None
        return self.mesh.get_group(axis).group_name

    def forward(self, x, top_k_index, top_k_weights, params, key: str) -> torch.Tensor:
        region, module = self.regions[key]
        p_leaves = [p.detach().requires_grad_(True) for p in params]
        groups = (self._group_name(region.axis, region.degree), self._group_name(region.tp_axis, region.tp_degree))
        chunks = _chunk_sizes(x.shape[0], region.chunks)
        outputs, pending = [], []
        for c, (start, size) in enumerate(chunks):
            # One token chunk (all tokens without overlap): its nodes carry the chunk's name, which
            # the expert_overlap pass schedules by.
            with fx_traceback.annotate({meta.EXPERT_CHUNK: f"{key}#{c}"}):
                x_leaf = _rows(x, start, size, len(chunks)).detach().requires_grad_(True)
                w = _rows(top_k_weights, start, size, len(chunks))
                w_leaf = w.detach().requires_grad_(w.is_floating_point())
                try:
                    with torch.enable_grad():
                        y = _region_forward(x_leaf, _rows(top_k_index, start, size, len(chunks)), w_leaf, p_leaves,
                                            region, module, *groups)
                except compat.DATA_DEPENDENT_ERRORS as exc:
                    raise _untraceable(region, module, exc) from exc
            outputs.append(y.detach())
            pending.append((y, x_leaf, w_leaf))
        self.pending[key] = (pending, p_leaves, chunks)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def backward(self, grad, key: str) -> list[torch.Tensor]:
        """``[d x, d top_k_weights, *d params]``: each chunk's autograd graph differentiated on its
        own (so its nodes carry its chunk's name), the chunks' rows concatenated, the weights'
        gradients summed."""
        pending, p_leaves, chunks = self.pending.pop(key)
        dx, dw, dparams = [], [], None
        for c, ((y, x_leaf, w_leaf), (start, size)) in enumerate(zip(pending, chunks)):
            with fx_traceback.annotate({meta.EXPERT_CHUNK: f"{key}#{c}"}):
                leaves = [x_leaf, w_leaf, *p_leaves]
                wanted = [leaf for leaf in leaves if leaf.requires_grad]
                got = iter(torch.autograd.grad(y, wanted, _rows(grad, start, size, len(chunks)), allow_unused=True))
                grads = [next(got) if leaf.requires_grad else None for leaf in leaves]
                grads = [g if g is not None else torch.zeros_like(leaf) for g, leaf in zip(grads, leaves)]
            dx.append(grads[0])
            dw.append(grads[1])
            dparams = grads[2:] if dparams is None else [a + b for a, b in zip(dparams, grads[2:])]
        if len(chunks) == 1:
            return [dx[0], dw[0], *dparams]
        return [torch.cat(dx), torch.cat(dw), *dparams]


def _chunk_sizes(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """(first row, rows) of each token chunk; one chunk when there are too few tokens to split."""
    if chunks == 1 or tokens < chunks:
        return [(0, tokens)]
    base, extra = divmod(tokens, chunks)
    sizes = [base + (i < extra) for i in range(chunks)]
    return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]


def _rows(t: torch.Tensor, start: int, size: int, chunks: int) -> torch.Tensor:
    return t if chunks == 1 else t.narrow(0, start, size)
