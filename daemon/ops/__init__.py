"""Operating-system integration: systemd notification, watchdog and socket activation."""
