"""The physical pool shared by every cache group: large pages, handed out whole. Pure Python."""
from __future__ import annotations


class LargePagePool:
    """``num_pages`` large pages; page 0 holds every group's null block and is never handed
    out. A group splits the pages it takes into small pages of its own size and gives a page
    back only when none of its small pages holds a reference or cached content.

    Invariant: a page is either in the free list or owned by exactly one group.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one holds the null blocks), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self.owner: list[int | None] = [None] * num_pages

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def num_free(self) -> int:
        return len(self._free)

    def take(self, group: int) -> int | None:
        """A free page for ``group``, or None when none is free."""
        if not self._free:
            return None
        page = self._free.pop()
        self.owner[page] = group
        return page

    def give_back(self, page: int) -> None:
        assert self.owner[page] is not None and page != 0, f"page {page} is not owned"
        self.owner[page] = None
        self._free.append(page)
