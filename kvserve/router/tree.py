"""PrefixTree: the texts routed to one worker, as a character radix tree (SGLang's approximate tree).

The router cannot see a worker's cache; it remembers what it sent there. A match is the longest prefix of a
new request's text that some earlier request to that worker shared: its KV is likely still cached there.
The tree forgets least recently used leaves first once it holds more than a bound of characters
(`--max-tree-size`), as the worker's own cache evicts least recently used blocks.
"""
from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("text", "children", "parent", "last_access")

    def __init__(self, text: str, parent: "_Node | None", last_access: int):
        self.text = text
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_access = last_access


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """Texts inserted, with their shared prefixes stored once; `size` is the characters stored."""

    def __init__(self):
        self._root = _Node("", None, 0)
        self._clock = itertools.count(1)
        self.size = 0

    def match(self, text: str) -> int:
        """Characters of `text` that prefix some inserted text."""
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_prefix(child.text, text[pos:])
            pos += common
            if common < len(child.text):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Remember `text`; every node on its path becomes the most recently used."""
        now = next(self._clock)
        node, pos = self._root, 0
        node.last_access = now
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                node.children[text[pos]] = _Node(text[pos:], node, now)
                self.size += len(text) - pos
                return
            common = _common_prefix(child.text, text[pos:])
            if common < len(child.text):
                child = self._split(child, common)
            child.last_access = now
            node, pos = child, pos + common

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut child's edge after `at` characters; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.text[:at], parent, child.last_access)
        parent.children[upper.text[0]] = upper
        child.text = child.text[at:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def evict(self, max_size: int) -> int:
        """Drop least recently used leaves until at most max_size characters remain; returns how many were dropped."""
        if self.size <= max_size:
            return 0
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        dropped = 0
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.text[0]]
            self.size -= len(leaf.text)
            dropped += len(leaf.text)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return dropped

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                leaves.append(node)
        return leaves

    def check_invariants(self) -> None:
        """size equals the characters on every edge; no empty edge below the root; children keyed by first char."""
        total, stack = 0, [self._root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.text and child.text[0] == first and child.parent is node, "bad edge"
                total += len(child.text)
                stack.append(child)
        assert total == self.size, f"size {self.size} but {total} characters stored"
