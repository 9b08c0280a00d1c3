"""The model, rank and objective core that both ``server`` and ``export`` build on; it imports neither."""
