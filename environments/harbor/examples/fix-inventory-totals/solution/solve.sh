#!/bin/bash
set -e
cd /app
sed -i 's/return RATES\["eu"\]/return RATES[region]/' inventory/tax.py
sed -i 's/discounted = subtotal - discount_pct/discounted = subtotal * (1 - discount_pct \/ 100)/' inventory/orders.py
