"""Drivers that simulate fleets on Flower's simulation engine, and their reports."""
