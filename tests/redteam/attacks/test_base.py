"""The attack contract's prepared-state cache: memory here, storage behind two hooks (``read``, ``write``)."""

from __future__ import annotations

import torch

from guardfl.redteam.attacks import PreparedCache


def test_a_folder_cache_stores_and_a_new_cache_reads_it_back(tmp_path):
    state = {"w": torch.arange(3.0), "n": 2}
    PreparedCache(tmp_path).save("learned_inversion", "k1", state)
    assert (tmp_path / "learned_inversion-k1.pt").is_file()
    again = PreparedCache(tmp_path)
    assert again.entries() == {}
    loaded = again.load("learned_inversion", "k1")
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 2
    assert list(again.entries()) == ["learned_inversion-k1"]  # held in memory once read
    assert again.load("learned_inversion", "other") is None
    memory_only = PreparedCache()
    memory_only.save("a", "k", 1)
    assert memory_only.load("a", "k") == 1 and memory_only.read("a-k") is None


def test_another_store_overrides_the_storage_hooks_only():
    class Store(PreparedCache):
        def __init__(self):
            super().__init__(None)
            self.stored: dict = {}

        def read(self, entry):
            return self.stored.get(entry)

        def write(self, entry, state):
            self.stored[entry] = state

    store = Store()
    store.save("a", "k", 1)
    assert store.stored == {"a-k": 1} and store.entries() == {"a-k": 1}
    other = Store()
    other.stored = {"a-k": 2}
    assert other.load("a", "k") == 2 and other.entries() == {"a-k": 2}
    other.adopt({"b-k": 3})  # the base adopts into memory only
    assert other.entries() == {"a-k": 2, "b-k": 3} and "b-k" not in other.stored
