"""``EncoderCacheManager``: the scheduler's book of the worker's encoder-output cache.

The worker keeps each encoded image's features (``worker.image_embeds``) keyed by the image's
content hash; this torch-free book decides what is there, so scheduler and worker always
agree (vLLM's ``EncoderCacheManager`` design). Sizes are in feature vectors (placeholder
tokens): the cache holds at most ``capacity`` (``--encoder-cache-size``) and one step encodes
at most ``budget`` (``--max-num-encoder-input-tokens``; the first image of a step may exceed
it, so an image larger than the budget still runs, alone, as vLLM raises its budget to the
largest item).

A request references each image it schedules until a step computes the image's whole
placeholder run; referenced entries are never evicted. Unreferenced entries stay for later
requests (a hit costs no encoder work) and go least recently used first when room is needed;
their hashes travel in the next ``SchedulerOutput.encoder_frees`` and the worker drops them
before it encodes that step's images. References end one ``schedule()`` late
(``release_done``), so a step's own frees never touch the features that step reads.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenwire.runtime.multimodal import ImageInput


@dataclass(slots=True)
class EncoderPlan:
    """One request's encoder work in one step: tokens it may compute (cut before the first
    image that does not fit) and the images to encode (index, hash) and hit."""

    begin: int
    num_new: int
    encode: list[tuple[int, ImageInput]] = field(default_factory=list)
    hits: list[ImageInput] = field(default_factory=list)
    done: list[str] = field(default_factory=list)  # hashes whose run this step completes
    cost: int = 0


class EncoderCacheManager:
    def __init__(self, capacity: int, budget: int) -> None:
        self.capacity = capacity
        self.budget = budget
        self._entries: OrderedDict[str, int] = OrderedDict()  # hash -> tokens, LRU first
        self._refs: dict[str, int] = {}
        self._held: dict[str, list[str]] = {}  # request id -> hashes it references
        self._release: list[tuple[str, str]] = []  # (request id, hash) after this step
        self._frees: list[str] = []  # evicted since the last drain: the worker drops them
        self.used = 0
        self.num_hits_total = 0
        self.num_evictions_total = 0
        self.step_spent = 0  # encoder tokens scheduled in the current step

    def __len__(self) -> int:
        return len(self._entries)

    def start_step(self) -> None:
        """A new ``schedule()``: runs completed by the previous step stop being referenced."""
        for request_id, content_hash in self._release:
            self._unref(request_id, content_hash)
        self._release.clear()
        self.step_spent = 0

    def drain_frees(self) -> tuple[str, ...]:
        frees, self._frees = tuple(self._frees), []
        return frees

    def plan(
        self, images: tuple[ImageInput, ...], begin: int, num_new: int, whole: bool = False
    ) -> EncoderPlan:
        """The images overlapping prompt positions ``[begin, begin + num_new)``: hits, and
        what to encode while the step budget and the cache's room allow; the first image that
        does not fit cuts ``num_new`` at its run's start (``whole``: no cut, no tokens), and
        so does a bidirectional image's run (Gemma 3) that the step would not complete."""
        end = begin + num_new
        overlapping = [(i, im) for i, im in enumerate(images) if im.offset < end and begin < im.end]
        protected = {im.content_hash for _, im in overlapping if im.content_hash in self._entries}
        room = self.capacity - self.used + self._evictable(protected)
        plan = EncoderPlan(begin, num_new)
        planned: set[str] = set()
        for index, image in overlapping:
            key = image.content_hash
            if image.bidirectional and image.end > end:  # never part of such a run
                plan.num_new = 0 if whole else max(0, image.offset - begin)
                break
            if key in self._entries or key in planned:
                plan.hits.append(image)
            else:
                over = self.step_spent + plan.cost + image.length > self.budget
                first = self.step_spent == 0 and (whole or not plan.encode)
                if (over and not first) or image.length > room:
                    plan.num_new = 0 if whole else max(0, image.offset - begin)
                    break
                room -= image.length
                plan.cost += image.length
                planned.add(key)
                plan.encode.append((index, image))
            if image.end <= end:
                plan.done.append(key)
        return plan

    def commit(self, request_id: str, plan: EncoderPlan) -> int:
        """The request was scheduled with ``plan``: reserve, reference; returns the hits (an
        image whose run this step starts, or first reaches, read from the cache)."""
        if not plan.hits and not plan.encode:
            return 0
        held = self._held.setdefault(request_id, [])
        hits = 0
        for image in plan.hits:  # referenced first: the evictions below never take them
            key = image.content_hash
            if key in self._entries:
                self._entries.move_to_end(key)
            if image.offset >= plan.begin or key not in held:
                hits += 1
            self._ref(held, key)
        for _, image in plan.encode:
            self._evict_for(image.length)
            self._entries[image.content_hash] = image.length
            self.used += image.length
            self._ref(held, image.content_hash)
        self._release.extend((request_id, h) for h in plan.done)
        self.step_spent += plan.cost
        self.num_hits_total += hits
        return hits

    def free_request(self, request_id: str) -> None:
        """Finished or preempted: every reference of the request ends now."""
        for content_hash in self._held.pop(request_id, []):
            self._drop_ref(content_hash)
        self._release = [(r, h) for r, h in self._release if r != request_id]

    def num_referenced(self) -> int:
        return sum(1 for count in self._refs.values() if count > 0)

    def _ref(self, held: list[str], content_hash: str) -> None:
        if content_hash not in held:
            held.append(content_hash)
            self._refs[content_hash] = self._refs.get(content_hash, 0) + 1

    def _unref(self, request_id: str, content_hash: str) -> None:
        held = self._held.get(request_id)
        if held is None or content_hash not in held:
            return
        held.remove(content_hash)
        if not held:
            del self._held[request_id]
        self._drop_ref(content_hash)

    def _drop_ref(self, content_hash: str) -> None:
        count = self._refs.get(content_hash, 0) - 1
        if count > 0:
            self._refs[content_hash] = count
        else:
            self._refs.pop(content_hash, None)

    def _evictable(self, protected: set[str]) -> int:
        return sum(
            n for h, n in self._entries.items() if h not in self._refs and h not in protected
        )

    def _evict_for(self, tokens: int) -> None:
        """Drop least recently used unreferenced entries until ``tokens`` fit."""
        for key in list(self._entries):
            if self.capacity - self.used >= tokens:
                return
            if key in self._refs:
                continue
            self.used -= self._entries.pop(key)
            self._frees.append(key)
            self.num_evictions_total += 1
        assert self.capacity - self.used >= tokens, "encoder cache: planned room is gone"
