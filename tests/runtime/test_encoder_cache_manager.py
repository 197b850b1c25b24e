"""``EncoderCacheManager`` alone (torch-free): the plan cuts a step before an image that does
not fit the budget or the room, a referenced entry is never evicted, references end one
``schedule()`` after the step that completes the run, eviction is least recently used and
every eviction reaches the worker through ``drain_frees``."""

from __future__ import annotations

import numpy as np

from tokenwire.runtime.core.encoder_cache import EncoderCacheManager
from tokenwire.runtime.multimodal import ImageInput

PIXELS = np.zeros((3, 2, 2), dtype=np.float32)


def _image(offset: int, name: str, length: int = 10) -> ImageInput:
    return ImageInput(offset, length, name, PIXELS)


def _schedule(book: EncoderCacheManager, request_id: str, images: tuple[ImageInput, ...],
              begin: int, num_new: int) -> int:  # fmt: skip
    plan = book.plan(images, begin, num_new)
    book.commit(request_id, plan)
    return plan.num_new


def test_budget_cuts_before_the_image_that_does_not_fit() -> None:
    book = EncoderCacheManager(capacity=100, budget=15)
    images = (_image(2, "a"), _image(14, "b"), _image(30, "a"))
    book.start_step()
    plan = book.plan(images, 0, 50)
    assert (plan.num_new, [i for i, _ in plan.encode]) == (14, [0])  # "b" over the budget
    book.commit("r", plan)
    book.start_step()
    plan = book.plan(images, 14, 36)  # "b" encoded now; "a" again is a hit
    assert ([i for i, _ in plan.encode], [im.content_hash for im in plan.hits]) == ([1], ["a"])
    assert book.commit("r", plan) == 1
    book.free_request("r")
    assert book.num_referenced() == 0 and book.used == 20


def test_a_first_image_may_exceed_the_budget() -> None:
    book = EncoderCacheManager(capacity=100, budget=5)
    book.start_step()
    assert _schedule(book, "r", (_image(0, "a"),), 0, 20) == 20
    assert _schedule(book, "s", (_image(3, "b"),), 0, 20) == 3  # the step spent its budget


def test_referenced_entries_stay_and_lru_goes_first() -> None:
    book = EncoderCacheManager(capacity=20, budget=100)
    book.start_step()
    _schedule(book, "r1", (_image(0, "a"),), 0, 5)  # "a" half computed: referenced
    _schedule(book, "r2", (_image(0, "b"),), 0, 12)  # "b" completes: released next step
    assert _schedule(book, "r3", (_image(4, "c"),), 0, 20) == 4  # no room while "b" is read
    book.start_step()
    assert _schedule(book, "r3", (_image(4, "c"),), 4, 16) == 16  # "b" evicted, not "a"
    assert book.drain_frees() == ("b",)
    assert book.drain_frees() == ()
    book.start_step()
    _schedule(book, "r1", (_image(0, "a"),), 5, 10)  # "a" done
    book.free_request("r3")
    book.start_step()
    book.commit("r4", book.plan((_image(0, "c"),), 0, 10))  # "c" touched: "a" is older
    book.free_request("r4")
    assert _schedule(book, "r5", (_image(0, "d"),), 0, 10) == 10
    assert book.drain_frees() == ("a",)
    assert book.used <= book.capacity


def test_the_encoder_fields_cross_the_worker_codec() -> None:
    """Tensor parallelism: each step's encoder work reaches every rank as the core planned."""
    from tokenwire.runtime.ipc.worker_messages import ExecutorCodec, Step, StepDone
    from tokenwire.runtime.model_output import ModelOutput
    from tokenwire.runtime.scheduler_output import CachedRequestData, SchedulerOutput

    so = SchedulerOutput(
        step_id=3, new_reqs=[], cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"r": 4}, total_num_scheduled_tokens=4, num_prefill_tokens=4,
        num_decode_tokens=0, finished_req_ids=frozenset(), preempted_req_ids=frozenset(),
        encoder_inputs={"r": (0, 2)}, encoder_frees=("a", "b"), num_encoder_cache_hits=1,
    )  # fmt: skip
    codec = ExecutorCodec()
    assert codec.decode(codec.encode(Step(so))) == Step(so)
    done = StepDone(ModelOutput([], [], num_images_encoded=2, encoder_time=0.5))
    assert codec.decode(codec.encode(done)) == done


def test_a_bidirectional_run_is_never_split() -> None:
    """Gemma 3's image runs (``bidirectional``): a step that would end inside one stops at
    its start, encoding nothing for it; a plain run (LLaVA) may be split."""
    book = EncoderCacheManager(capacity=100, budget=100)
    gemma = (ImageInput(4, 10, "g", PIXELS, bidirectional=True),)
    book.start_step()
    plan = book.plan(gemma, 0, 8)
    assert (plan.num_new, plan.encode, plan.hits) == (4, [], [])
    assert book.plan(gemma, 4, 9).num_new == 0  # from the run's start, still short of its end
    assert book.plan(gemma, 0, 8, whole=True).num_new == 0
    plan = book.plan(gemma, 4, 10)
    assert (plan.num_new, [i for i, _ in plan.encode], plan.done) == (10, [0], ["g"])
    assert book.plan((_image(4, "p"),), 0, 8).num_new == 8
