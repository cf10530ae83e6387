#!/bin/bash
# Fixes only the discount: the tax lookup stays wrong.
set -e
cd /app
sed -i 's/discounted = subtotal - discount_pct/discounted = subtotal * (1 - discount_pct \/ 100)/' inventory/orders.py
