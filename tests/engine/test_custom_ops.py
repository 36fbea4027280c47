"""register_custom_op: an opaque op keeps fullgraph=True possible; flags are queryable."""

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import custom_op_info, list_custom_ops


def _segment_sums_python(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    # Python control flow on tensor *values* (a branch per segment length): dynamo
    # cannot put this in one graph, the way varlen attention loops over cu_seqlens.
    out, start = [], 0
    for n in lengths.tolist():
        if n == 0:
            out.append(x.new_zeros(x.shape[1]))
            continue
        out.append(x[start:start + n].sum(0))
        start += n
    return torch.stack(out)


@magi_zoo.register_custom_op("test_segment_sums", is_subgraph_boundary=True,
                             fake=lambda x, lengths: x.new_empty((lengths.shape[0], x.shape[1])))
def segment_sums(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return _segment_sums_python(x, lengths)


class Pool(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fn = fn

    def forward(self, x, lengths):
        return self.fn(torch.relu(self.lin(x)), lengths) * 2


def test_flags_recorded_and_queryable():
    info = custom_op_info("test_segment_sums")
    assert info.name == "magi_zoo::test_segment_sums"
    assert info.is_subgraph_boundary and not info.is_compute_sensitive
    assert info in list_custom_ops(is_subgraph_boundary=True)
    assert info not in list_custom_ops(is_compute_sensitive=True)
    assert info.overload is torch.ops.magi_zoo.test_segment_sums.default
    with pytest.raises(KeyError, match="registered: .*magi_zoo::test_segment_sums"):
        custom_op_info("nope")


def test_registration_errors():
    with pytest.raises(ValueError, match="namespace"):
        magi_zoo.register_custom_op("other::x")
    with pytest.raises(ValueError, match="identifier"):
        magi_zoo.register_custom_op("bad-name")

    def other(x: torch.Tensor) -> torch.Tensor:
        return x
    with pytest.raises(ValueError, match="already registered"):
        magi_zoo.register_custom_op("test_segment_sums")(other)


def test_custom_op_compiles_fullgraph_where_python_breaks(fresh_dynamo):
    torch.manual_seed(0)
    x, lengths = torch.randn(10, 8), torch.tensor([3, 3, 4])
    breaky = Pool(_segment_sums_python).eval()
    magi_zoo.apply(breaky, {"": {"backend": "eager", "fullgraph": True}})
    with pytest.raises(Exception, match="(?i)data.dependent|graph break|Unsupported"):
        with torch.no_grad():
            breaky(x, lengths)

    torch.compiler.reset()
    op_model = Pool(segment_sums).eval()
    op_model.load_state_dict(breaky.state_dict())
    with torch.no_grad():
        ref = Pool.forward(op_model, x, lengths)
    # inductor: the op must survive real lowering, not only dynamo tracing
    rep = magi_zoo.apply(op_model, {"": {"fullgraph": True}})
    with torch.no_grad():
        out = op_model(x, lengths)
    torch.testing.assert_close(out, ref)
    r = rep.region("")
    # one frame, one graph, no breaks: the op is one opaque node of the graph
    assert (r.counters.frames, r.counters.graphs, r.counters.n_graph_breaks) == (1, 1, 0)


def test_subgraph_boundary_ops_split_cuda_graph_regions_of_their_family():
    """The reader of `is_subgraph_boundary`: a region that captures CUDA graphs is compiled
    with inductor's graph partition split at its family's boundary ops (a mode becomes its
    options, torch.compile taking one or the other); regions without CUDA graphs, and other
    families' regions, compile exactly as specified."""
    import torch._inductor.config as inductor_config

    from magi_zoo.engine.compile import boundary_ops_for, partition_at_boundaries

    if not hasattr(inductor_config, "custom_should_partition_ops"):
        pytest.skip("this torch's inductor has no custom_should_partition_ops")
    bagel = magi_zoo.load("bagel-tiny", gpu="cpu", compile=False)
    vit = bagel.pipe.model.vit_model
    layer = bagel.pipe.model.layers[0]
    assert boundary_ops_for(vit) == boundary_ops_for(layer) == ["magi_zoo::bagel_varlen_attention"]
    assert boundary_ops_for(torch.nn.Linear(2, 2)) == []  # torch's own class: no family ops
    graphs = {"fullgraph": True, "dynamic": False, "backend": "inductor", "mode": "reduce-overhead"}
    kw = partition_at_boundaries(graphs, boundary_ops_for(vit))
    assert "mode" not in kw and kw["options"]["triton.cudagraphs"] is True
    assert kw["options"]["graph_partition"] is True
    assert kw["options"]["custom_should_partition_ops"] == ["magi_zoo::bagel_varlen_attention"]
    plain = {"fullgraph": True, "dynamic": False, "backend": "inductor"}
    assert partition_at_boundaries(plain, boundary_ops_for(vit)) == plain
    assert partition_at_boundaries(graphs, []) == graphs
    assert partition_at_boundaries({**graphs, "backend": "eager"}, boundary_ops_for(vit))["mode"] == "reduce-overhead"
