"""Autoscaler (signals, forecast, policy, placement, controller, actuators) and the fleet simulator."""
