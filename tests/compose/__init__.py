"""make compose-check: docker-compose.yml run for real, on stand-ins where no image pulls."""
