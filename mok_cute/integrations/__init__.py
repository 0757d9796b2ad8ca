"""Adapters that plug mok_cute into other libraries' MoE layers (above the public API; each
imports its library only when called, so importing mok_cute never imports them)."""
