"""The fault-injection suite (docs/reliability.md): real signals, processes and files against train.py."""
