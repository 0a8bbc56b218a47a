"""balancing"""
