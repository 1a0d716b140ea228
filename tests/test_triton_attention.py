

def test_registry_offers_triton_paged_where_it_can_run(monkeypatch):
    from kvserve.attention.registry import make_backend

    with pytest.raises(ValueError, match="unquantized"):
        make_backend("triton_paged", "cpu", quantized_kv=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA only"):
        make_backend("triton_paged", "cpu")
    assert make_backend("auto", "cpu").name in ("cpu_paged", "torch_ref")  # the CPU's choice is unchanged
