"""KV connectors (vLLM's KVConnectorBase_V1 seam): move KV blocks between this engine's cache and a store or a
peer. base.py is the contract, factory.py builds one by name, connectors/ holds the local ones."""
