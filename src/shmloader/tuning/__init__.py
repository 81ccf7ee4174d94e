"""Where a loader's time goes, and the tuner that acts on it."""
