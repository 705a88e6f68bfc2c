import copy

import pytest
import torch

from lib.offload_adamw import HostBuffer, buckets, into_host_buffers, offloaded_adamw_step


def test_buckets_are_consecutive_runs_within_the_budget_and_a_large_tensor_stands_alone():
    assert buckets([3, 3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert buckets([], 6) == []
    assert sum(buckets(list(range(1, 20)), 25), []) == list(range(19))


@pytest.mark.parametrize("bucket_numel", [7, 64, 10_000])
def test_offloaded_step_is_torch_adamw_step_bit_for_bit(bucket_numel):
    torch.manual_seed(0)
    shapes = [(4, 5), (30,), (3, 3, 3), (1,), (50, 2)]  # (50, 2) alone exceeds the smallest bucket
    reference = [torch.randn(s) for s in shapes]
    masters = [p.clone() for p in reference]
    models = [p.to(torch.bfloat16) for p in reference]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(reference, **kwargs)
    offloaded = torch.optim.AdamW(masters, **kwargs)
    for step in range(4):
        grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]
        scale = torch.tensor(0.5 + 0.25 * step)
        for p, g in zip(reference, grads):
            p.grad = g.float() * scale
        torch_adamw.step()
        offloaded_adamw_step(offloaded, masters, grads, models, device=torch.device("cpu"), grad_scale=scale,
                             bucket_numel=bucket_numel)
        for group in (torch_adamw.param_groups[0], offloaded.param_groups[0]):
            group["lr"] *= 0.5  # a schedule: the step reads the group's current lr
    for ref, master, model in zip(reference, masters, models):
        assert torch.equal(master, ref)
        assert torch.equal(model, ref.to(torch.bfloat16))
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(offloaded.state[master][key], torch_adamw.state[ref][key]), key


def test_offloaded_step_state_loads_into_a_plain_adamw_and_steps_the_same():
    torch.manual_seed(1)
    masters = [torch.randn(6, 4)]
    offloaded = torch.optim.AdamW(masters, lr=1e-2)
    offloaded_adamw_step(offloaded, masters, [torch.randn(6, 4)], [torch.empty(6, 4)], device=torch.device("cpu"))
    plain_params = [masters[0].clone()]
    plain = torch.optim.AdamW(plain_params, lr=1e-2)
    plain.load_state_dict(copy.deepcopy(offloaded.state_dict()))  # load shares tensors
    grad = torch.randn(6, 4)
    plain_params[0].grad = grad * 0.5
    plain.step()
    before = grad.clone()
    offloaded_adamw_step(offloaded, masters, [grad], [torch.empty(6, 4)], device=torch.device("cpu"), grad_scale=0.5)
    assert torch.equal(grad, before)  # an fp32 gradient is scaled on a copy, not in place
    assert torch.equal(plain_params[0], masters[0])
    assert float(plain.state[plain_params[0]]["step"]) == float(offloaded.state[masters[0]]["step"]) == 2.0

def test_host_buffer_views_are_consecutive_tensors_of_one_buffer():
    buffer = HostBuffer(4 * 5 + 3 + 2 * 2)
    a, b, c = buffer.views([torch.Size([4, 5]), torch.Size([3]), torch.Size([2, 2])])
    assert (a.shape, b.shape, c.shape) == ((4, 5), (3,), (2, 2))
    assert all(v.untyped_storage().data_ptr() == buffer.tensor.untyped_storage().data_ptr() for v in (a, b, c))
    c.fill_(7.0)
    assert buffer.tensor[-4:].tolist() == [7.0] * 4 and buffer.tensor[:-4].eq(0).all()


def test_into_host_buffers_holds_masters_and_fresh_state_and_takes_loaded_state_back():
    torch.manual_seed(2)
    masters = [torch.randn(3, 4, requires_grad=True), torch.randn(5), torch.randn(2, 2, requires_grad=True)]
    # masters[1] is frozen (requires_grad False): no optimizer state
    values = [m.clone() for m in masters]
    optimizer = torch.optim.AdamW(masters, lr=1e-2)
    buffers = into_host_buffers(optimizer)
    storages = [b.tensor.untyped_storage().data_ptr() for b in buffers]
    assert [torch.equal(m, v) for m, v in zip(masters, values)] == [True] * 3
    assert all(m.untyped_storage().data_ptr() == storages[0] for m in masters)
    assert masters[1] not in optimizer.state
    for m in (masters[0], masters[2]):
        state = optimizer.state[m]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert (state["exp_avg"].untyped_storage().data_ptr(), state["exp_avg_sq"].untyped_storage().data_ptr()) == \
            tuple(storages[1:])
    saved = copy.deepcopy(optimizer.state_dict())
    for group_state in saved["state"].values():
        group_state["exp_avg"].fill_(0.25)
    optimizer.load_state_dict(saved)  # tensors of its own
    assert into_host_buffers(optimizer, buffers) is buffers
    for m in (masters[0], masters[2]):
        assert optimizer.state[m]["exp_avg"].untyped_storage().data_ptr() == storages[1]
        assert optimizer.state[m]["exp_avg"].eq(0.25).all()
