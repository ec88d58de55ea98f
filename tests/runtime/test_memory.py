"""What engines cost loaded together (runtime/memory.py): readings, what grew between two, and the
directory's total in load order. Measuring in a fresh process is tests/exporter/test_budget.py's."""
import torch

from c2w.runtime.manifest import Entry
from c2w.runtime.memory import CUDA_KIND, HOST_KIND, Reading, memory_kind, summarize


def _entry(key_id, comp, nbytes, status="built"):
    return Entry(id=key_id, component=comp, dims={"B": 1}, dtype="float32", category="steady", status=status,
                 device_bytes=nbytes)


def test_summarize_adds_up_in_load_order():
    loads = [(_entry("a1", "a", 0), {"bytes": 7, "shared": {"a": 3}, "seconds": 1.5}),
             (_entry("b1", "b", 0), {"bytes": 2, "shared": {}, "seconds": 0.25}),
             (_entry("a2", "a", 0), {"bytes": 5, "shared": {}, "seconds": 0.0})]
    s = summarize({"a": 100, "b": 10}, loads)
    assert s["per_key"] == [["a1", 7, 110], ["b1", 2, 122], ["a2", 5, 127]]
    assert (s["total_bytes"], s["weight_bytes"], s["key_bytes"], s["engine_shared_bytes"]) == (127, 110, 14, {"a": 3, "b": 0})
    assert s["load_seconds"] == 1.75


def test_a_host_reading_grows_by_bytes_and_never_shrinks_below_zero():
    assert Reading(1000).minus(Reading(400)) == {"bytes": 600}
    assert Reading(400).minus(Reading(1000)) == {"bytes": 0}            # memory given back is no negative cost


def test_a_cuda_reading_splits_the_growth_into_allocated_pool_and_outside():
    """used 1000 -> 1600, of which PyTorch reserved 300 -> 700 and allocated 100 -> 350: 250 more
    allocated, 150 more reserved but not allocated (graph pools, cached blocks), 200 outside."""
    grew = Reading(1600, allocated=350, reserved=700).minus(Reading(1000, allocated=100, reserved=300))
    assert grew == {"bytes": 600, "allocated": 250, "pool": 150, "outside": 200}


def test_memory_kind_follows_the_device():
    assert memory_kind(torch.device("cpu")) == HOST_KIND == "host_anon"
    assert memory_kind(torch.device("cuda", 0)) == CUDA_KIND == "cuda_device"
