"""What users call: ``release()``, ``offloading()``, ``prewarm()``."""
