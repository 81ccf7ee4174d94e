"""The worker processes: their main loop, their pool, their failures and their seeding."""
