"""Rollout engines (embedded transformers generation; SGLang over HTTP) and the collector that scores them."""
