"""What is loaded in which order: samplers, torch's random draws, sharding across ranks."""
