"""The update-boundary check every save runs: which parameters hold unapplied gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_bridge.capture import boundary  # noqa: E402


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_parameter_held_by_a_model_and_an_optimizer_is_reported_once() -> None:
    boundary.install()
    model, optimizer = _model_and_optimizer()
    model(torch.randn(5, 4)).sum().backward()
    objects = {"model": model, "optimizer": optimizer}
    assert boundary.unapplied_gradients(objects.items()) == [
        "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]
    assert boundary.unapplied_gradients([("optimizer", optimizer), ("model", model)])[:2] == [
        "optimizer group 0 parameter 0", "optimizer group 0 parameter 1"]
    optimizer.step()
    assert boundary.unapplied_gradients(objects.items()) == []
    model(torch.randn(5, 4)).sum().backward()  # accumulates into the consumed gradients
    assert len(boundary.unapplied_gradients(objects.items())) == 4


def test_a_parameter_stepped_before_the_hook_saw_it_is_not_judged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    boundary.install()
    model, _ = _model_and_optimizer()
    optimizer = torch.optim.Adam(model.parameters())  # Adam keeps state per parameter
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    first = next(model.parameters())
    monkeypatch.setattr(boundary, "_consumed", torch.utils.weak.WeakIdKeyDictionary())
    assert boundary.unapplied_gradients([("model", model), ("optimizer", optimizer)]) == []
    assert boundary.unapplied_gradients([("model", model)]) == [  # no optimizer state known
        "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]
    first.grad = None
    assert boundary.unapplied_gradients([("model", model)])[0] == "model.0.bias"
