"""The physical pool shared by every cache group: large pages, handed out whole. Pure Python."""
from __future__ import annotations


class LargePagePool:
    """``num_pages`` large pages; page 0 holds every group's null block and is never handed
    out. A group splits the pages it takes into small pages of its own size and gives a page
    back only when none of its small pages holds a reference or cached content.

    Invariant: a page is either in the free list or owned by exactly one group.

    ``quota`` (group -> most pages it may own) fixes a split between groups, for comparison with
    the default elastic pool, where any group takes any free page.
    """

    def __init__(self, num_pages: int, quota: dict[int, int] | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one holds the null blocks), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self.owner: list[int | None] = [None] * num_pages
        self.quota = dict(quota or {})
        self._owned: dict[int, int] = {}

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def num_free(self) -> int:
        return len(self._free)

    def take(self, group: int) -> int | None:
        """A free page for ``group``, or None when none is free."""
        if not self._free or self._owned.get(group, 0) >= self.quota.get(group, self.num_pages):
            return None
        page = self._free.pop()
        self.owner[page] = group
        self._owned[group] = self._owned.get(group, 0) + 1
        return page

    def give_back(self, page: int) -> None:
        assert self.owner[page] is not None and page != 0, f"page {page} is not owned"
        self._owned[self.owner[page]] -= 1
        self.owner[page] = None
        self._free.append(page)
