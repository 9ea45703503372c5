"""A fresh optimizer's state dict is complete even when gradients are already set: torch's state-dict
functions skip initialising the state of an optimizer that has none when any gradient exists, so the
state would be silently missing from a save, and a load would put nothing into it
(``state_dict._fresh_state_initialisable``)."""

import torch
import torch.nn as nn

import hyper_parallel as hp


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_state_dict_of_a_fresh_optimizer_with_gradients_is_complete():
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = hp.get_optimizer_state_dict(model, opt)
    assert set(state["state"]) == {"weight", "bias"}
    assert set(state["state"]["weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)  # put back


def test_loading_into_a_fresh_optimizer_with_gradients_loads_the_state():
    """As load_checkpoint loads: the fresh optimizer's own state dict is the template whose tensors
    the saved values are read into (DCP fills what the template has), then it is set. Without the
    state initialised despite the gradients, the template has no state and nothing is loaded."""
    source, source_opt = _trained()
    saved = hp.get_optimizer_state_dict(source, source_opt)
    model = nn.Linear(4, 3)
    model.load_state_dict(source.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()  # gradients exist before the load
    template = hp.get_optimizer_state_dict(model, opt)
    for fqn, values in template["state"].items():
        for key, value in values.items():
            value.copy_(saved["state"][fqn][key])
    hp.set_optimizer_state_dict(model, opt, template)
    loaded = hp.get_optimizer_state_dict(model, opt)
    assert set(loaded["state"]) == set(saved["state"]) == {"weight", "bias"}
    for fqn, values in saved["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(loaded["state"][fqn][key], value, rtol=0, atol=0)
